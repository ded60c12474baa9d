"""Beam search on a DSBD engine with draft-free sources against the same engine with ``"sources": []``, in one
process: LLM.beam_search W = 4, 16 tokens, the 4 code-edit prompts, 6 calls per engine after a warm-up (medians), with
the beam counters of the last call (beam steps per target pass). ``PR=0`` in the environment switches the recycle
source's prompt rows off (``source_drafter.PROMPT_ROWS``), to split what a sources engine costs when it drafts nothing.

    python benchmarks/engine/beam_floor.py none recycle,lookup none recycle,lookup
    PR=0 python benchmarks/engine/beam_floor.py none recycle,lookup
"""
import sys, time, statistics
sys.path.insert(0, "benchmarks/engine")
if __name__ == "__main__":
    import sources_wall as sw
    from draftfree import prompts as kind_prompts
    from vllm_dsbd.testing.models import smollm2_dir, load_tokenizer
    from vllm.sampling_params import BeamSearchParams
    folder = smollm2_dir()
    enc = [(k, p) for k, p in kind_prompts(load_tokenizer(folder), 4) if k == "code-edit"]
    ps = [{"prompt_token_ids": p} for _, p in enc]
    bp = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True)
    import os
    if os.environ.get("PR") is not None:
        import vllm_dsbd.engine.source_drafter as sd; sd.PROMPT_ROWS = int(os.environ["PR"])
    for s in sys.argv[1:]:
        llm = sw.engine(folder, s, None)
        llm.beam_search(ps[:1], BeamSearchParams(beam_width=4, max_tokens=2, ignore_eos=True))
        ts = []
        for _ in range(6):
            c0 = {k: sw.metric(llm, k) for k in sw.COUNTERS}
            t0 = time.perf_counter(); llm.beam_search(ps, bp); ts.append(time.perf_counter() - t0)
            c = {k: sw.metric(llm, k) - c0[k] for k in sw.COUNTERS}
        print("RESULT", s, [round(t, 3) for t in ts], "median", round(statistics.median(ts), 3), c, flush=True)
        sw.shutdown(llm)
