"""The decode loop: draft -> verify -> accept -> commit -> observe; solo and continuously batched.

One per-sequence step logic (:class:`DecodingSequence`: first token, drafting, acceptance, KV commit,
truncation, observation, feedback, step record) serves the batch-1 loops
(:func:`generate_vanilla`, :func:`generate_speculative`) and :class:`BatchEngine`, which verifies
the trees of all live sequences in one target forward. Vanilla is the same logic with trees of
one token.

The batch-1 loops run on the same :class:`TargetBackend` (the in-process :class:`TargetModel`, or a
proxy over Ray actors), so speedups compare like with like and the distributed path reuses this
exact loop. Every speculative step is recorded as a :class:`StepRecord`; all metrics are
computed from those records.

Output rule (both loops): generation stops after ``max_new_tokens`` tokens or at the first EOS
token (kept in the output), so a step that accepts past either point is truncated there.
Both loops release the target's sequence (its KV cache, or the shards' caches) when generation
ends, normally or by an error.

Modules:

* :mod:`speculation.engine.sequence`: one sequence's step, the TargetBackend protocol, step records.
* :mod:`speculation.engine.solo`: the batch-1 loops, generate_vanilla and generate_speculative.
* :mod:`speculation.engine.batch`: continuous batching, BatchEngine and its requests (scheduling
  only: how much to draft is :class:`~speculation.policy.draft_budget.DraftBudgetPolicy`'s).
"""
