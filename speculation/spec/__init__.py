"""The speculative-decoding algorithm: the draft tree, batched argmax / top-k picks over its
logits, and greedy and lossless stochastic acceptance.
"""
