"""
Checkpoints: conversion to and from Hugging Face's `afmoe` format.

    from checkpoint import from_hf_state_dict, to_hf_state_dict
    model.load_state_dict(from_hf_state_dict(hf_model.state_dict(), cfg), strict=True)
"""

import re

import torch

from model import ModelConfig

# Our name -> transformers' name, per layer ("{}" is the layer index). Everything else is one-to-one below.
_LAYER_KEYS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_post_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_mlp_layernorm.weight",
    "ffn_post_norm.weight": "post_mlp_layernorm.weight",
    **{f"attn.{p}.weight": f"self_attn.{p}.weight"
       for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "q_norm", "k_norm")},
    **{f"ffn.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
    **{f"ffn.shared.{p}.weight": f"mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
    "ffn.router.weight": "mlp.router.gate.weight",
    "ffn.expert_bias": "mlp.expert_bias",
    "ffn.experts.gate_up_proj": "mlp.experts.gate_up_proj",
    "ffn.experts.down_proj": "mlp.experts.down_proj",
}
_TOP_KEYS = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")


def _hf_name(ours: str) -> str:
    if ours in _TOP_KEYS:
        return _TOP_KEYS[ours]
    m = _LAYER_RE.fullmatch(ours)
    if m is None or m.group(2) not in _LAYER_KEYS:
        raise KeyError(f"state-dict key {ours!r} has no Hugging Face counterpart")
    return f"model.layers.{m.group(1)}.{_LAYER_KEYS[m.group(2)]}"


def _our_names(cfg: ModelConfig) -> list[str]:
    from model import meta_model
    return list(meta_model(cfg).state_dict().keys())


def to_hf_state_dict(sd: dict, cfg: ModelConfig) -> dict:
    """Our state dict -> transformers' AfmoeForCausalLM state dict (same tensors, renamed)."""
    return {_hf_name(k): v for k, v in sd.items()}


def from_hf_state_dict(hf_sd: dict, cfg: ModelConfig) -> dict:
    """transformers' AfmoeForCausalLM state dict -> one that Transformer(cfg).load_state_dict(strict=True) takes."""
    wanted = {_hf_name(k): k for k in _our_names(cfg)}
    missing = sorted(set(wanted) - set(hf_sd))
    if missing:
        raise KeyError(f"the Hugging Face state dict lacks {len(missing)} tensors this config needs, "
                       f"e.g. {missing[:3]}; is it an afmoe model with the same number of layers and experts?")
    out = {}
    for hf_key, ours in wanted.items():
        t = hf_sd[hf_key]
        out[ours] = t.float() if ours.endswith("expert_bias") else t
    return out
