"""Beams inside one vLLM request (``docs/design.md`` §2, "Full width lives inside one vLLM request"), with or without DSBD's
draft forest.

A beam request keeps its W live beams as a trie of nodes stored in the request's own KV slots, after its linear
context (the prompt, then the beams' common prefix; ``base`` slots). vLLM's token list of the request is always
``linear context + trie node tokens in slot order`` (node j at slot ``base + j``), so vLLM's tokens, block hashes
and recomputation after a preemption see the true token of every slot. The trie's leaves (the live beams' last
tokens) are always its last nodes: leaf 0 is vLLM's last token (not yet in the cache) and leaves 1.. are scheduled as
the request's "draft tokens". A node's RoPE position is ``P - 1 + depth`` (P = prompt length, depth counted from
the prompt) and its attention sees the linear context and its own ancestors (``attention.ForestBatch`` with context
``base`` over the trie).

After each step the draft model beam-searches (T = 0) or beam-samples (T > 0) a forest a few steps ahead of the live
beams (``drafter.py``): W nodes per depth, stored after the trie (forest node c at slot
``base + len(trie) + c``) and scheduled as draft tokens after the leaves, so one target pass computes the leaves and
the forest together.

One beam step, when the logits of every leaf are in (``step.step_one`` / ``step.step_beams``):

* T = 0: vLLM's ``LLM.beam_search``: each live beam's top ``2W`` tokens are candidates (raw log-probabilities,
  cumulative scores summed in float64 as vLLM sums Python floats); a candidate ending in EOS finishes (unless EOS is
  ignored); the ``W`` best other candidates (stable sort, as vLLM's ``sorted``) are the new live beams. With a
  forest: while the W new beams are all forest nodes, their logits are in this pass too, so the next beam step runs
  on them at once (a forest layer *passed*); the first step whose beams are not all forest nodes ends the pass. The
  draft only decides how many steps one target pass makes: every step is the target's own, so the beams are vLLM's.
* T > 0: target beam sampling: ``W`` (beam, token) pairs drawn without replacement from the joint
  (``core.beam_step``); a drawn pair ending in EOS finishes. With a forest (drawn by the draft's beam sampling, its
  joint Q kept per depth), each layer is DSBD's exact verification (``core.verify_layer``'s decisions, computed on
  the device without host reads by ``core.verify_static``: recursive rejection sampling without replacement, so the
  W outputs are W draws without replacement from the target joint): while the new beams are all forest nodes the
  next layer runs on their logits. The beams' law is target beam sampling
  whatever the draft (with ``dynamic_width`` the paper's rule picks each drafted layer's width from P and Q).

Then the nodes the new beams hang from (leaves and passed forest nodes) are kept and moved down in slot order to
the first free slots (:class:`StepResult` says which slots move), except that the leaves already in vLLM's token
list never move (a pruned one stays as a dead node), so vLLM's token at every slot stays true. What goes back to
vLLM is the row ``[kept nodes after vLLM's last token] + [new leaf 0]``: vLLM appends it, counts ``len(row) - 1``
accepted drafts and rolls back the rest, which lands exactly on the new layout. When vLLM scheduled (or, after a
preemption, recomputed) only some of the leaves, the step waits: the logits of the computed leaves are kept and the
row is the next leaves (:meth:`BeamRequest.partial`); the forest is dropped.

Then the request is *re-laid out* (:meth:`BeamRequest._relayout`, ``docs/design.md`` §2): the live beams' common prefix
leaves the trie and becomes linear context after the prompt (slots ``[prompt_len, base)``, position = slot, attended
causally like the prompt), every dead node (on no live beam: pruned beams, finished beams' tokens) is dropped, and
the kept nodes move down in slot order; vLLM's token list of the request is rewritten to match (runner and scheduler,
patch ``beam_scheduler``), so the request holds ``base + live trie`` slots instead of every slot it ever kept, and
forest attention runs over the live trie only. ``VLLM_DSBD_BEAM_RELAYOUT=0`` turns it off (for comparisons).

What vLLM outputs for the request is not its token list (trie slots) but its *settled prefix*
(:meth:`BeamRequest.settle`, after every step): the longest common prefix of the live beams and the ``n`` best
finished beams so far. Every beam the request can still return is one of those or descends from a live beam, so a
settled token is never retracted (a finished beam that drops out of the ``n`` best never comes back). When the
search ends, the rest of the best beam follows.

Files: ``trie.py`` (:class:`~.trie.BeamRequest`: the trie, its forest, the answer), ``step.py`` (the batched beam
step and its verified layers), ``sampling.py`` (the device work of beam sampling: joint draws, verified layers, the
top rows a T = 0 step reads), ``drafter.py`` (the draft forests). None of them imports vLLM.
"""
