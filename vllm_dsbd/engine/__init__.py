"""The DSBD engine inside vLLM 0.26.0: plain requests verified against draft forests, and beam requests (beam search and
beam sampling) whose beams live inside the engine, with or without a draft model.

:mod:`.worker` builds :mod:`.runner`'s DSBD runner, which hooks the engine step: request states (:mod:`.state`), forest
attention (:mod:`.attention`, :mod:`.kv`), verification (:mod:`.sampler`, :mod:`.fused`), drafting (:mod:`.drafter`),
beam requests (:mod:`.beams`), host reads (:mod:`.reads`), load-aware speculation (:mod:`.load`), graph safety
(:mod:`.graphs`), start-up refusals (:mod:`.support`), working memory (:mod:`.memory`) and metrics (:mod:`.metrics`,
:mod:`.prometheus`). Importing this
package imports nothing from vLLM; :mod:`.runner` and :mod:`.drafter` do. The story: docs/design.md (index, §3);
the module map: docs/design/modules.md §4.
"""
