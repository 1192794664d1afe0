"""Write an EAGLE-3 head in vLLM's EAGLE-3 format (``vllm/model_executor/models/llama_eagle3.py``).

The output directory holds ``config.json`` (a Llama config with one layer) and
``model.safetensors``. Tensor names map one to one (H = hidden size, N_d = draft vocabulary,
V = target vocabulary, I = FFN size):

================================  =================================================  ============
graftblock (:class:`Eagle3Model`)  vLLM                                               shape
================================  =================================================  ============
``fc``                            ``fc``                                             [H, 3H]
``embed_norm``                    ``midlayer.input_layernorm``                       [H]
``hidden_norm``                   ``midlayer.hidden_norm``                           [H]
``q_proj`` / ``k_proj`` / ...     ``midlayer.self_attn.{q,k,v,o}_proj``              [nh*hd, 2H]..
``post_norm``                     ``midlayer.post_attention_layernorm``              [H]
``gate_proj`` / ``up_proj`` / ..  ``midlayer.mlp.{gate,up,down}_proj``               [I, H]..
``final_norm``                    ``norm``                                           [H]
``lm_head``                       ``lm_head``                                        [N_d, H]
``d2t``                           ``d2t`` (int64 offsets: target id = i + d2t[i])    [N_d]
``t2d``                           ``t2d`` (bool, target id is in the draft vocab)    [V]
================================  =================================================  ============

Both sides compute the same function: ``u = [RMSNorm_in(Emb(x)); RMSNorm_hidden(g)]``,
``y = g + o(Attn(q(u), k(u), v(u)))``, ``y = y + MLP(RMSNorm_post(y))``, logits
``= lm_head(RMSNorm(y))``, with ``g = fc([h_a; h_b; h_c])`` where ``h_i`` is the hidden state
entering target layer ``i`` (Hugging Face's ``hidden_states[i]``, vLLM's aux layer id ``i``).
The embeddings are not written: vLLM shares the target's embedding with the draft when the
checkpoint has none, as graftblock does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from speculation.drafters.checkpoint import EAGLE3, TargetFingerprint, load_checkpoint, read_header
from speculation.drafters.eagle3_model import Eagle3Arch, Eagle3Model

VLLM_ARCHITECTURE = "Eagle3LlamaForCausalLM"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

TENSOR_NAMES: dict[str, str] = {
    "fc.weight": "fc.weight",
    "embed_norm.weight": "midlayer.input_layernorm.weight",
    "hidden_norm.weight": "midlayer.hidden_norm.weight",
    "q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "post_norm.weight": "midlayer.post_attention_layernorm.weight",
    "gate_proj.weight": "midlayer.mlp.gate_proj.weight",
    "up_proj.weight": "midlayer.mlp.up_proj.weight",
    "down_proj.weight": "midlayer.mlp.down_proj.weight",
    "final_norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
    "t2d": "t2d",
}
"""graftblock state-dict key -> vLLM EAGLE-3 tensor name (every persistent tensor of the head)."""


def vllm_config(arch: Eagle3Arch, fingerprint: TargetFingerprint, target_config: dict, dtype: torch.dtype) -> dict:
    """The draft's ``config.json``: the target's Llama settings with one layer and the draft vocab.

    ``target_config`` is the target's own ``config.json`` (context length, RoPE scaling and
    special-token ids are copied from it); the head's shape comes from ``arch``.
    """
    rope = dict(target_config.get("rope_parameters") or {"rope_type": "default"})
    rope["rope_theta"] = arch.rope_theta
    return {
        "architectures": [VLLM_ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_parameters": rope,
        "max_position_embeddings": int(target_config["max_position_embeddings"]),
        "vocab_size": arch.target_vocab_size,
        "draft_vocab_size": arch.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": target_config.get("bos_token_id"),
        "eos_token_id": target_config.get("eos_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": list(fingerprint.aux_layers),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(fingerprint.aux_layers)},
        "graftblock": {"target": fingerprint.to_dict()},
    }


def vllm_tensors(model: Eagle3Model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's tensors under vLLM's names; floats cast to ``dtype``, ``d2t`` int64, ``t2d`` bool."""
    state = model.state_dict()
    if set(state) != set(TENSOR_NAMES):
        raise ValueError(f"EAGLE-3 state dict keys {sorted(state)} != the mapped keys {sorted(TENSOR_NAMES)}")
    return {
        TENSOR_NAMES[k]: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
        for k, v in state.items()
    }


def export_vllm_eagle3(checkpoint: str | Path, out_dir: str | Path, target_config: dict,
                       dtype: torch.dtype = torch.float32) -> Path:
    """Write ``checkpoint`` (graftblock EAGLE-3 format) to ``out_dir`` in vLLM's format; returns ``out_dir``.

    The checkpoint is loaded against its own recorded fingerprint (the target is not needed);
    ``target_config`` is the target's ``config.json`` and must agree with that fingerprint.
    """
    arch, fingerprint = read_header(checkpoint, EAGLE3)
    for key, want in (("hidden_size", fingerprint.hidden_size), ("vocab_size", fingerprint.vocab_size),
                      ("num_hidden_layers", fingerprint.num_layers)):
        if int(target_config[key]) != want:
            raise ValueError(f"target config {key} = {target_config[key]} but the checkpoint was trained for {want}")
    aux = list(fingerprint.aux_layers)
    if aux != sorted(set(aux)):
        # vLLM collects the aux hidden states in increasing layer order; fc's input blocks follow ours.
        raise ValueError(f"aux_layers {aux} must be strictly increasing to match vLLM's feature order")
    model = load_checkpoint(checkpoint, fingerprint, dtype=torch.float32, kind=EAGLE3)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(vllm_tensors(model, dtype), str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    tmp.replace(out / WEIGHTS_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(vllm_config(arch, fingerprint, target_config, dtype), indent=1))
    return out
