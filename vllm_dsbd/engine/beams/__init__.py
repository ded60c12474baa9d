"""Beam requests: the W beams of one vLLM request, stepped inside the engine, with or without a draft forest.

A beam request keeps its live beams as a trie in its own KV slots after its linear context (the prompt, then the beams'
common prefix); vLLM's token list is always ``linear context + trie tokens in slot order``, so its tokens, block hashes
and recomputation stay true. Each step is the target's own beam step (vLLM's ``LLM.beam_search`` at T = 0, target beam
sampling at T > 0), repeated on the draft forest while its layers pass; then the kept nodes move down, the request is
re-laid out, and its settled prefix is what vLLM outputs. Files: ``trie.py`` (:class:`~.trie.BeamRequest`), ``step.py``
(the batched step), ``sampling.py`` (T > 0 device work), ``drafter.py`` (draft forests), ``grammar.py`` (structured
outputs, T = 0). None of them imports vLLM. The
story: docs/design/beams.md §3.3.
"""
