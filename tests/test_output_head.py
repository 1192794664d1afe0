"""The transposed output head and the oneDNN-packed linear layers: same products as ``nn.Linear``
(to rounding), same tied weight, nothing new saved."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speculation import assets
from speculation.model.output_head import (
    PackedLinear,
    TransposedHead,
    onednn_available,
    pack_linears,
    use_transposed_head,
)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch has no oneDNN on this platform")


@pytest.mark.parametrize("kind", [TransposedHead, pytest.param(PackedLinear, marks=needs_onednn)])
def test_replacement_computes_the_linear_product_with_or_without_bias(kind):
    gen = torch.Generator().manual_seed(0)
    for bias in (False, True):
        lin = nn.Linear(16, 40, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(40, 16, generator=gen))
        fast = kind(lin)
        assert fast.weight is lin.weight and fast.bias is lin.bias  # the same parameters, not copies
        x = torch.randn(3, 5, 16, generator=gen)
        with torch.inference_mode():
            y = fast(x)
            torch.testing.assert_close(y, lin(x), rtol=1e-5, atol=1e-5)
        assert y.shape == (3, 5, 40)


@needs_onednn
def test_the_packed_copy_follows_the_weight_through_loads_optimizer_steps_copies_and_casts():
    """A packed layer whose weight changes (load_state_dict, an optimizer step, a deepcopy then a
    load, a dtype cast) computes with the new weight at its next product, never the old packing."""
    import copy

    gen = torch.Generator().manual_seed(1)
    lin = nn.Linear(16, 24)
    net = nn.Sequential(lin)
    pack_linears(net)
    x = torch.randn(4, 16, generator=gen)

    def product(module, inp):
        with torch.inference_mode():
            return module(inp)

    def check(module, inp):  # against F.linear on the weight as it is now
        want = nn.functional.linear(inp, module[0].weight.detach(), module[0].bias.detach())
        tol = 1e-2 if inp.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(product(module, inp), want, rtol=tol, atol=tol)

    check(net, x)
    net.load_state_dict({"0.weight": torch.randn(24, 16, generator=gen), "0.bias": torch.randn(24, generator=gen)})
    check(net, x)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    net(x.requires_grad_(False)).square().sum().backward()  # autograd: F.linear
    opt.step()
    check(net, x)
    twin = copy.deepcopy(net)
    twin.load_state_dict({"0.weight": torch.randn(24, 16, generator=gen), "0.bias": torch.zeros(24)})
    check(twin, x)
    check(net, x)  # the original is untouched by its copy's load
    assert not torch.equal(product(twin, x), product(net, x))
    net.to(torch.bfloat16)
    check(net, x.to(torch.bfloat16))
    # Packed again in bf16 only where this CPU's oneDNN has bf16 kernels; else F.linear, no error.
    assert (net[0].current_packed() is not None) == onednn_available(torch.bfloat16)
    # A weight made in inference mode has no version counter: products go through F.linear.
    with torch.inference_mode():
        frozen = PackedLinear(nn.Linear(16, 24))
    assert frozen.current_packed() is None
    check(nn.Sequential(frozen), x)


@needs_onednn
def test_packed_linear_falls_back_for_autograd_and_packs_heads_except_skipped():
    lin = nn.Linear(16, 40)
    packed = PackedLinear(lin)
    # With autograd on, the product goes through F.linear and has a gradient.
    x = torch.randn(2, 16, requires_grad=True)
    packed(x).sum().backward()
    assert x.grad is not None and x.grad.shape == (2, 16)
    # A TransposedHead is packed too, keeping its (tied) parameter.
    head = TransposedHead(nn.Linear(16, 40, bias=False))
    holder = nn.Sequential(nn.Linear(16, 16), head)
    assert pack_linears(holder) == 2 and all(isinstance(m, PackedLinear) for m in holder)
    assert holder[1].weight is head.weight
    # ``skip`` leaves one layer alone (a pipeline shard's head it never runs).
    other = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 40))
    assert pack_linears(other, skip=other[1]) == 1 and type(other[1]) is nn.Linear


@pytest.mark.slow  # real weights
@needs_onednn
def test_a_shard_without_the_head_does_not_pack_it():
    model = assets.load_model("smollm2-135m", torch.float32, layers=range(0, 2))
    assert type(model.get_output_embeddings()) is nn.Linear  # no packed copy of the largest weight
    assert isinstance(model.model.layers[0].mlp.down_proj, PackedLinear)


@pytest.mark.slow  # real weights
def test_the_loaded_target_keeps_its_tied_head_and_state_dict():
    model = assets.load_model("smollm2-135m", torch.float32)
    head = model.get_output_embeddings()
    assert isinstance(head, PackedLinear if onednn_available() else TransposedHead)
    assert head.weight is model.get_input_embeddings().weight  # still tied: no second parameter
    saved = model.state_dict()
    assert not any(k.endswith(("weight_t", "packed")) for k in saved)  # checkpoints are unchanged
    if onednn_available():  # every linear layer of the decoder is packed
        assert not any(type(m) is nn.Linear for m in model.modules())
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        out = model(input_ids=ids).logits
        hidden = model.model(input_ids=ids).last_hidden_state
        ref = nn.functional.linear(hidden, head.weight)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert use_transposed_head(model) is False  # already replaced: nothing to do


@needs_onednn
def test_a_packed_network_pickles_and_its_copy_packs_its_own_weight():
    import pickle

    net = nn.Sequential(nn.Linear(8, 8))
    pack_linears(net)
    x = torch.randn(2, 8)
    back = pickle.loads(pickle.dumps(net))
    with torch.inference_mode():
        torch.testing.assert_close(back(x), net(x))
    assert back[0]._copy.held is not None and back[0]._copy.held is not net[0]._copy.held
