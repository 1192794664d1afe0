"""The transposed output head: same products as ``nn.Linear``, same tied weight, nothing new saved."""

from __future__ import annotations

import torch
from torch import nn

from speculation import assets
from speculation.output_head import TransposedHead, use_transposed_head


def test_transposed_head_computes_the_linear_product_with_or_without_bias():
    gen = torch.Generator().manual_seed(0)
    for bias in (False, True):
        lin = nn.Linear(16, 40, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(40, 16, generator=gen))
        head = TransposedHead(lin)
        x = torch.randn(3, 5, 16, generator=gen)
        assert head.weight is lin.weight and (head.bias is lin.bias)
        torch.testing.assert_close(head(x), lin(x), rtol=1e-5, atol=1e-5)
        assert head(x).shape == (3, 5, 40)


def test_the_loaded_target_reads_its_tied_weight_through_the_transposed_head():
    model = assets.load_model("smollm2-135m", torch.float32)
    head = model.get_output_embeddings()
    assert isinstance(head, TransposedHead)
    assert head.weight is model.get_input_embeddings().weight  # still tied: no second parameter
    assert torch.equal(head.weight_t, head.weight.t())
    assert not any(k.endswith("weight_t") for k in model.state_dict())  # checkpoints are unchanged
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        out = model(input_ids=ids).logits
        hidden = model.model(input_ids=ids).last_hidden_state
        ref = nn.functional.linear(hidden, head.weight)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert use_transposed_head(model) is False  # already transposed: nothing to do
