"""What a step may spend: the verify-cost model c(T, L) and rank acceptance, the goodput split
of a batched step's tree budget, the realised payoff of drafting, and the
:class:`~speculation.policy.draft_budget.DraftBudgetPolicy` that holds that state for the batch engine.
"""
