"""Grouped sibling projections and the fused RMS norm: the same products as the separate layers
(to rounding), whatever order or inputs the siblings are called with; the same parameters and
state dict; and the loaded targets decode the same greedy tokens as without them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speculation import assets
from speculation.model.fused_layers import FusedRMSNorm, GroupedProjection, fuse_decoder
from speculation.model.output_head import onednn_available, pack_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch has no oneDNN on this platform")


class _Attn(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj = nn.Linear(16, 24, bias=bias)
        self.k_proj = nn.Linear(16, 8, bias=bias)
        self.v_proj = nn.Linear(16, 8, bias=bias)


@pytest.mark.parametrize("bias", [False, True])
def test_siblings_get_their_own_product_in_any_order_and_for_any_input(bias):
    torch.manual_seed(0)
    attn = _Attn(bias)
    ref = {name: getattr(attn, name) for name in ("q_proj", "k_proj", "v_proj")}
    keys = set(attn.state_dict())
    assert fuse_decoder(attn) == 3
    assert set(attn.state_dict()) == keys  # nothing renamed, nothing new saved
    assert all(getattr(attn, n).weight is ref[n].weight for n in ref)  # the same parameters
    x, other = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    with torch.inference_mode():
        want = {n: ref[n](x) for n in ref}
        want_other = {n: ref[n](other) for n in ref}
        # The usual order, a shuffled order, one projection twice, and an interleaved other input.
        for order in (("q_proj", "k_proj", "v_proj"), ("v_proj", "q_proj", "k_proj")):
            for n in order:
                torch.testing.assert_close(getattr(attn, n)(x), want[n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attn.k_proj(x), want["k_proj"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attn.k_proj(x), want["k_proj"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attn.q_proj(x), want["q_proj"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attn.k_proj(other), want_other["k_proj"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attn.v_proj(x), want["v_proj"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attn.v_proj(other), want_other["v_proj"], rtol=1e-5, atol=1e-5)
        assert attn.q_proj(x).shape == (2, 3, 24) and attn.v_proj(x).shape == (2, 3, 8)


def test_grouped_projection_falls_back_for_autograd_and_is_left_alone_by_pack_linears():
    attn = _Attn(bias=True)
    fuse_decoder(attn)
    x = torch.randn(2, 16, requires_grad=True)
    (attn.q_proj(x).sum() + attn.v_proj(x).sum()).backward()
    assert x.grad is not None and attn.q_proj.weight.grad is not None
    assert pack_linears(attn) == 0 and isinstance(attn.k_proj, GroupedProjection)
    # Siblings that do not share an input width or bias-ness are not grouped.
    mixed = _Attn(bias=False)
    mixed.v_proj = nn.Linear(16, 8, bias=True)
    assert fuse_decoder(mixed) == 0


def test_fused_rms_norm_matches_transformers_in_fp32_and_bf16():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    fused = FusedRMSNorm(norm)
    assert fused.weight is norm.weight
    x = torch.randn(4, 32)
    torch.testing.assert_close(fused(x), norm(x), rtol=1e-5, atol=1e-5)
    norm_bf16, fused_bf16 = norm.to(torch.bfloat16), FusedRMSNorm(norm.to(torch.bfloat16))
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(fused_bf16(xb), norm_bf16(xb), rtol=1e-2, atol=1e-2)


def _unfused(name: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    source = assets.resolve_model(name)
    model = AutoModelForCausalLM.from_pretrained(source.location, dtype=torch.float32, attn_implementation="sdpa",
                                                 **source.load_kwargs())
    pack_linears(model)
    return model.eval()


@pytest.mark.slow  # real weights
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_loaded_targets_are_fused_and_decode_the_same_greedy_tokens(name):
    fused, plain = assets.load_model(name, torch.float32), _unfused(name)
    grouped = [m for m in fused.modules() if isinstance(m, GroupedProjection)]
    layers = len(fused.model.layers)
    assert len(grouped) == 5 * layers  # q, k, v, gate, up in every layer
    assert set(fused.state_dict()) == set(plain.state_dict())
    ids = torch.tensor([[1, 417, 2156, 314, 260, 3467, 28, 1134, 30]])
    tokens = {}
    with torch.inference_mode():
        logits_f, logits_p = fused(input_ids=ids).logits, plain(input_ids=ids).logits
        torch.testing.assert_close(logits_f, logits_p, rtol=1e-3, atol=1e-3)
        for key, model in (("fused", fused), ("plain", plain)):
            out = model.generate(ids, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids))
            tokens[key] = out[0, ids.shape[1]:].tolist()
    assert tokens["fused"] == tokens["plain"]
