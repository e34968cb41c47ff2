"""Attention of decode steps on a CPU: a few queries per row (one token, or one plus its proposals) against the cached
keys, as two float32 matmuls. PyTorch's CPU SDPA kernel tiles queries in blocks meant for prefill, so at one query per
row it spends most of a decode step there (RESULTS.md "A real model: rollouts"); longer queries go to SDPA unchanged.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa

NAME = "spec_rl_decode"
#: Queries per row up to which the matmul form runs (a decode step with tail speculation feeds 1 + max_k).
MAX_QUERIES = 16


def decode_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Query [B, Hq, q, D], key/value [B, H_kv, kv, D], mask [B, 1, q, kv] (bool: attend; float: added) or None
    (causal, aligned to the last key) -> ([B, q, Hq, D], None); SDPA for long queries, dropout or soft-capping."""
    bsz, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    special = any(kwargs.get(k) is not None for k in ("softcap", "s_aux"))
    if q_len > MAX_QUERIES or dropout or heads % kv_heads or special:
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    group = heads // kv_heads
    scale = float(scaling) if scaling is not None else dim**-0.5
    grouped = query.reshape(bsz, kv_heads, group * q_len, dim).float()  # query head h uses key head h // group
    scores = torch.matmul(grouped, key.float().transpose(-1, -2)).view(bsz, kv_heads, group, q_len, kv_len) * scale
    if attention_mask is not None:
        mask = attention_mask[:, :, -q_len:, -kv_len:].reshape(bsz, 1, 1, q_len, kv_len)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    elif q_len > 1:
        rows = torch.arange(q_len, device=query.device).unsqueeze(1) + (kv_len - q_len)
        scores = scores.masked_fill(torch.arange(kv_len, device=query.device) > rows, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(bsz, kv_heads, group * q_len, kv_len)
    out = torch.matmul(probs, value.float()).to(query.dtype).view(bsz, heads, q_len, dim)
    return out.transpose(1, 2).contiguous(), None


@functools.cache  # once
def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, decode_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str):
    """Run ``model`` with the registered attention ``name``; every config is restored afterwards."""
    configs = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and id(cfg) not in configs:
            configs[id(cfg)] = (cfg, cfg._attn_implementation)
    try:
        for cfg, _ in configs.values():
            cfg._attn_implementation = name
        yield
    finally:
        for cfg, impl in configs.values():
            cfg._attn_implementation = impl


def decode_attention(model: torch.nn.Module):
    """The context of a decode step: the matmul form on a CPU where the model runs SDPA, else nothing changes."""
    device = next(model.parameters()).device
    if device.type != "cpu" or getattr(getattr(model, "config", None), "_attn_implementation", None) != "sdpa":
        return contextlib.nullcontext()
    register()
    return attention_implementation(model, NAME)
