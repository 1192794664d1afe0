"""Running the target: :class:`~speculation.model.target.TargetModel` (prefill, one-pass tree
verification, KV compaction), the lean decoder loop, fused layers, packed output heads, KV
slots and reserved KV rows, and the tree-attention inputs every backend builds its forwards from.
"""
