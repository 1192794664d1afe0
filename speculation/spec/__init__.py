"""The speculative-decoding algorithm: the draft tree, batched argmax / top-k picks over its
logits, greedy and lossless stochastic acceptance, and the plain data a batched step hands between
scheduler, budget policy and verifier (:mod:`speculation.spec.step`).
"""
