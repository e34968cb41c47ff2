"""The decode-step attention equals float64 attention on fresh random inputs, and the model under it decodes alike."""

import pytest
import torch
from tiny_models import tiny_model

from spec_rl.backends.decode_attention import MAX_QUERIES, decode_attention, decode_attention_forward


def _reference(query, key, value, allowed, scale):
    """float64 attention; ``allowed`` [B, q, kv] bool."""
    group = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    s = query.double() @ k.transpose(-1, -2) * scale
    s = s.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


@pytest.mark.parametrize("q_len", [1, 3, MAX_QUERIES])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
def test_decode_attention_matches_float64(q_len, mask_kind, heads, kv_heads):
    gen = torch.Generator().manual_seed(q_len * 100 + heads)
    bsz, kv_len, dim = 3, 19, 8
    query = torch.randn(bsz, heads, q_len, dim, generator=gen)
    key = torch.randn(bsz, kv_heads, kv_len, dim, generator=gen)
    value = torch.randn(bsz, kv_heads, kv_len, dim, generator=gen)
    causal = torch.arange(kv_len) <= (torch.arange(q_len).unsqueeze(1) + kv_len - q_len)
    allowed = causal.expand(bsz, q_len, kv_len).clone()
    allowed[0, :, :2] = False  # left padding of row 0
    mask = {"bool": allowed.unsqueeze(1), "float": torch.where(allowed, 0.0, -1e30).unsqueeze(1), "none": None}
    if mask_kind == "none":
        allowed = causal.expand(bsz, q_len, kv_len)
    out, weights = decode_attention_forward(None, query, key, value, mask[mask_kind], scaling=0.3)
    assert weights is None and out.shape == (bsz, q_len, heads, dim)
    torch.testing.assert_close(out.double(), _reference(query, key, value, allowed, 0.3), atol=1e-5, rtol=1e-5)


def test_long_queries_go_to_sdpa_unchanged():
    gen = torch.Generator().manual_seed(5)
    q_len = MAX_QUERIES + 1
    query, key, value = (torch.randn(2, 4, q_len, 8, generator=gen) for _ in range(3))
    out, _ = decode_attention_forward(torch.nn.Module(), query, key, value, None, scaling=0.5, is_causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=0.5)
    torch.testing.assert_close(out, expected.transpose(1, 2))


def test_the_model_under_decode_attention_gives_the_same_logits_and_restores_its_config():
    model = tiny_model(seed=2)
    model.config._attn_implementation = "sdpa"
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        prefix = model(input_ids=ids[:, :4], attention_mask=mask[:, :4], use_cache=True)
        plain = model(input_ids=ids[:, 4:], attention_mask=mask, past_key_values=prefix.past_key_values).logits
        prefix = model(input_ids=ids[:, :4], attention_mask=mask[:, :4], use_cache=True)
        with decode_attention(model):
            assert model.config._attn_implementation != "sdpa"
            mine = model(input_ids=ids[:, 4:], attention_mask=mask, past_key_values=prefix.past_key_values).logits
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(mine, plain, atol=1e-5, rtol=1e-5)
