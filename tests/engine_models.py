"""Tiny random Llama / Qwen2 / Qwen3 causal LMs (fp32) for the engine tests."""

from __future__ import annotations

import torch
from tiny_models import WORDS, tiny_model

FAMILIES = ("qwen2", "llama", "qwen3")


def tiny_family_model(family: str, seed: int = 0, vocab_size: int = len(WORDS), layers: int = 2, hidden: int = 32):
    """A ~30k-parameter model of ``family`` with GQA (4 query heads, 2 KV heads), EOS id 1."""
    if family == "qwen2":
        return tiny_model(vocab_size=vocab_size, seed=seed, layers=layers, hidden=hidden)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if family == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        # head_dim set explicitly (Qwen3 decouples it from hidden / heads) and q/k norms active.
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).eval()
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


@torch.no_grad()
def greedy_reference(model, context, steps, eos_ids=()):
    """Argmax decoding by full forwards over the growing sequence (no cache): the ground truth."""
    ids = list(context)
    out = []
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        t = int(logits.argmax())
        out.append(t)
        ids.append(t)
        if t in eos_ids:
            break
    return out
