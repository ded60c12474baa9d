"""Every forest draws fresh draft noise: the mechanism behind ``rng.forest_position`` (docs/deviations.md D10), checked
on the numbers a real engine draws.

The default engine (no draft model: recycle + lookup), T > 0, depth 3 pinned (cost model off, verify budget null: full
forests every step, so forests fail at every depth; on this CPU the cost model would switch most off), plain requests at
W = 1 and W = 2 and beam-sampling requests; every ``DRAFT_DRAW`` key the drafter actually draws with (the position word
handed to ``core.beam_step`` for a row with a live slot, or to ``source_drafter.draft_keys`` for the requests that draw
on the host, with the request's seed) is recorded with the forest it was drawn for (its root, from
``rng.forest_position``'s arguments). The promise "every forest draws numbers nothing before it
used" (``core/rng.py``) is then checked directly: no request draws two forests' noise from the same position word.

Not vacuous: each request verifies several forests and some fail before their last drafted depth (the next root comes
before the previous forest's deepest drawn position: exactly where a keying by the node's position reuses numbers).
Power: the old keying (``forest_position = root + depth``, until 2026-12-06) planted in the same test is caught, the
check counting the position words it reuses. A law test cannot see that keying at a feasible size (its effect needs a
rare coincidence: ``test_engine_sources_law.py``'s docstring); this check sees its every occurrence.

SmolLM2-135M, the sources law test's prompts. Measured 2026-12-06 (CPU, 47 s): exact W = 1 35 forests for 8
requests, 11 failed early, 0 reuses; W = 2 37 forests, 17 failed early, 0 reuses; beams 19 forests for 6 requests, 9
failed early, 0 reuses. Old keying: W = 1 16 reused words, W = 2 22, beams 18.
"""
from __future__ import annotations

from collections import defaultdict

import pytest

from engine_utils import dsbd_llm  # the CPU engine environment first
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

import vllm_dsbd.engine.beams.sampling as beam_sampling_mod  # noqa: E402
import vllm_dsbd.engine.source_drafter as source_drafter_mod  # noqa: E402
from vllm_dsbd.core import rng as rng_mod  # noqa: E402

# the law test's prompts (test_engine_sources_law.py): random letters (flat laws: about 60% of plain forests fail at
# their first layer, 2.3 forests per 8 tokens) and, for beams, a list to repeat (beam forests pass layers there)
TEXT = "Random letters: q x m b t k w f z d r h p j v c y g n s l"
BEAM_TEXT = ("Repeat the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape, kiwi\n"
             "Repeat: apple, banana,")
DEPTH, WIDTH, TOKENS, N_PLAIN, N_BEAM, BEAM_STEPS = 3, 2, 16, 8, 6, 8
BEAM = {"width": 2, "max_tokens": BEAM_STEPS, "ignore_eos": True, "depth": DEPTH, "nodes": 2}


def old_keying(root, depth):
    """The planted variant: DRAFT_DRAW keyed by the node's position (until 2026-12-06)."""
    return root + depth


class Recorder:
    """Wraps ``rng.forest_position`` (the keying under test: exact or planted), the drafters' ``beam_step`` and the
    host path's ``draft_keys``: each ``DRAFT_DRAW`` step appends, per request row with a live slot, (seed, root, depth,
    position word)."""

    def __init__(self):
        self.draws: list[tuple[int, int, int, int]] = []
        self._roots = None

    def install(self, mp, keying):
        def forest_position(root, depth):
            self._roots = (root, depth)
            return keying(root, depth)

        def recorded(real):
            def beam_step(logits, scores, live, params, position, stream):
                if stream == rng_mod.Stream.DRAFT_DRAW:
                    root, depth = self._roots
                    R = live.shape[0]
                    roots = root.tolist() if hasattr(root, "tolist") else root
                    roots = roots if isinstance(roots, list) else [roots] * R
                    words = position.tolist()
                    for r, (seed, alive) in enumerate(zip(params.seed.tolist(), live.any(-1).tolist())):
                        if alive:
                            self.draws.append((seed, int(roots[r]), int(depth), int(words[r])))
                    self._roots = None
                return real(logits, scores, live, params, position, stream)
            return beam_step

        def host_keys(real):  # plain requests without rows to process draw on the host (source_drafter.host_layers)
            def draft_keys(seed, root, depth):
                words = forest_position(root, depth)
                self._roots = None
                for s, r, w in zip(seed.tolist(), root.tolist(), words.tolist()):
                    self.draws.append((s, r, depth, w))
                return real(seed, root, depth)
            return draft_keys

        mp.setattr(rng_mod, "forest_position", forest_position)
        mp.setattr(source_drafter_mod, "draft_keys", host_keys(source_drafter_mod.draft_keys))
        mp.setattr(source_drafter_mod, "beam_step", recorded(source_drafter_mod.beam_step))
        mp.setattr(beam_sampling_mod, "beam_step", recorded(beam_sampling_mod.beam_step))

    def summary(self) -> dict:
        """Per request: its forests (roots), each forest's deepest drawn depth; the position words drawn by more than
        one forest (reuses), the forests whose successor's root comes before their deepest drawn position (failed
        early: where a keying by position would reuse)."""
        forests = defaultdict(lambda: defaultdict(int))  # seed -> root -> deepest drawn depth
        owners = defaultdict(lambda: defaultdict(set))  # seed -> word -> roots that drew it
        for seed, root, depth, word in self.draws:
            forests[seed][root] = max(forests[seed][root], depth)
            owners[seed][word].add(root)
        reuses = sum(len(roots) - 1 for words in owners.values() for roots in words.values())
        early = 0
        for f in forests.values():
            roots = sorted(f)
            early += sum(b < a + f[a] for a, b in zip(roots, roots[1:]))
        counts = [len(f) for f in forests.values()]
        return {"requests": len(forests), "forests": sum(counts), "min_forests": min(counts, default=0),
                "failed_early": early, "draws": len(self.draws), "reuses": reuses}


def _plain(llm, prompt, width):
    return llm.generate([{"prompt_token_ids": prompt}] * N_PLAIN,
                        [vllm.SamplingParams(temperature=1.0, max_tokens=TOKENS, ignore_eos=True, seed=1000 + s,
                                             detokenize=False, extra_args={"dsbd_width": width})
                         for s in range(N_PLAIN)], use_tqdm=False)


def _beams(llm, prompt):
    return llm.generate([{"prompt_token_ids": prompt}] * N_BEAM,
                        [vllm.SamplingParams(temperature=1.0, top_k=8, seed=2000 + s,
                                             max_tokens=BEAM_STEPS * 3 + 2, ignore_eos=True,
                                             detokenize=False, extra_args={"dsbd_beam": BEAM}) for s in range(N_BEAM)],
                        use_tqdm=False)


@pytest.fixture(scope="module")
def recorded():
    from vllm_dsbd.testing.models import load_tokenizer, smollm2_dir

    target = smollm2_dir()
    tok = load_tokenizer(target)
    plain_prompt, beam_prompt = (list(tok(t)["input_ids"]) for t in (TEXT, BEAM_TEXT))
    out = {}
    spec = {"method": "dsbd", "width": WIDTH, "num_speculative_tokens": DEPTH, "verify_budget": None}
    with dsbd_llm(target, max_num_seqs=64, speculative_config=spec) as llm:
        for keying in ("exact", "old keying"):
            for kind in ("W=1", "W=2", "beams"):
                rec = Recorder()
                with pytest.MonkeyPatch.context() as mp:
                    rec.install(mp, rng_mod.forest_position if keying == "exact" else old_keying)
                    if kind == "beams":
                        _beams(llm, beam_prompt)
                    else:
                        _plain(llm, plain_prompt, int(kind[2:]))
                out[keying, kind] = rec.summary()
                print(keying, kind, out[keying, kind])
    return out


@pytest.mark.parametrize("kind", ["W=1", "W=2", "beams"])
def test_every_forest_draws_fresh_noise(recorded, kind):
    exact, old = recorded["exact", kind], recorded["old keying", kind]
    n = N_BEAM if kind == "beams" else N_PLAIN
    # not vacuous: every request drafted, at least 2 forests per request, some failed before their deepest drawn depth
    assert exact["requests"] == n and exact["forests"] >= 2 * n, exact
    assert exact["failed_early"] > 0, exact
    assert exact["reuses"] == 0, exact  # no position word drawn by two forests of a request
    # power: the old keying, planted, reuses the words of the forests that failed early
    assert old["requests"] == n and old["failed_early"] > 0 and old["reuses"] > 0, old
