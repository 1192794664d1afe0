"""What a step may spend: the verify-cost model c(T, L) and rank acceptance, the goodput split
of a batched step's tree budget, and the realised payoff of drafting.
"""
