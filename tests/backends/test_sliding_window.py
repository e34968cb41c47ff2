"""Sliding-window models run in process: the window is read from the config as transformers applies it, and the
transformers backend honours it in token positions (left padding, rolled-back proposal columns and a continued scored
prefix included), so every response's log-probs equal one plain forward's over [prompt, response]."""

import copy

import pytest
import torch
from backend_jobs import generate
from tiny_models import full_forward_logprobs
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from spec_rl.acceptance.mode import RolloutMode
from spec_rl.acceptance.rules import Lenient
from spec_rl.backends.paged import PagedEngine
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.drafts.cache import RolloutCache
from spec_rl.drafts.history import SuffixAutomaton, SuffixProposer
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.sampling.groups import supports_tree_attention
from spec_rl.util.model_config import model_sliding_window

SMALL = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
)
WINDOW = 4
SLIDING = {
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**SMALL, sliding_window=WINDOW)),  # every layer slides
    "qwen2": (  # layer 2 slides, layer 1 attends to everything
        Qwen2ForCausalLM,
        lambda: Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "gemma2": (Gemma2ForCausalLM, lambda: Gemma2Config(**SMALL, sliding_window=WINDOW, head_dim=8)),  # alternating
}
PROMPTS = [[3, 11, 12, 13, 14, 15, 16, 17], [3, 15], [3, 17, 18, 19, 20]]


def _model(name, attn="sdpa"):
    cls, config = SLIDING[name]
    torch.manual_seed(0)
    cfg = config()
    cfg._attn_implementation = attn
    return cls(cfg).eval()


@pytest.mark.parametrize(
    "config, window",
    [
        (MistralConfig(**SMALL, sliding_window=16), 16),  # no switch, no layer types: the window alone
        (MistralConfig(**SMALL, sliding_window=None), None),
        (Qwen2Config(**SMALL), None),  # a window in the config, but use_sliding_window=False
        (Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=1), 8),  # layer 2 slides
        (Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=2), None),  # no layer slides
    ],
)
def test_the_window_is_read_as_transformers_applies_it(config, window):
    cls = MistralForCausalLM if isinstance(config, MistralConfig) else Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    assert model_sliding_window(model) == window
    assert window is None or not supports_tree_attention(model)  # a sliding model scores drafts row by row


def test_model_without_a_config_has_no_window():
    assert model_sliding_window(torch.nn.Linear(2, 2)) is None


def _assert_plain_forward(model, contexts, outs, temperature):
    for ctx, out in zip(contexts, outs):
        assert out.token_ids, "every row generates"
        ref = full_forward_logprobs(model, ctx, out.token_ids, temperature=temperature)
        assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), ref, atol=1e-4), (ctx, out)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(SLIDING))
def test_generation_past_the_window_equals_a_plain_forward(name, attn):
    model = _model(name, attn)
    settings = SamplingSettings(temperature=0.9, max_tokens=20)  # prompts + 20 tokens: the window binds
    backend = TransformersBackend(model, {1}, pad_id=0)
    outs = generate(backend, PROMPTS, [20] * 3, settings, seed=3)
    _assert_plain_forward(model, PROMPTS, outs, 0.9)
    # tail speculation: proposals rolled back leave holes in the cache columns; tokens and log-probs are unchanged
    history = SuffixAutomaton()
    for out in outs:
        history.add_response(out.token_ids[:6] + [5, 6, 7, 8] + out.token_ids[6:])  # right, then wrong, then right
    proposers = [SuffixProposer(history, max_k=4) for _ in PROMPTS]
    spec = TransformersBackend(copy.deepcopy(model), {1}, pad_id=0, adaptive_tail=False)
    again = generate(spec, PROMPTS, [20] * 3, settings, seed=3, proposers=proposers)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert spec.stats.proposed_tokens > spec.stats.accepted_tokens > 0  # proposals were fed, some rolled back
    _assert_plain_forward(model, PROMPTS, again, 0.9)


@pytest.mark.parametrize("name", list(SLIDING))
def test_speculative_rollouts_of_a_sliding_model_continue_exactly(name):
    model = _model(name)
    settings = SamplingSettings(temperature=1.0, max_tokens=16)
    requests = [RolloutRequest(p, s) for p in PROMPTS for s in range(2)]
    rollout = SpeculativeRollout(
        TransformersBackend(model, {1}, pad_id=0), RolloutCache(), settings, [1], 64, RolloutMode(Lenient(1.0)), seed=2
    )
    rollout.run(requests, step=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # the policy moved: drafts are cut and continued
    result = rollout.run(requests, step=1)
    assert 0 < result.stats.accepted_tokens < result.stats.draft_tokens
    for r, ids, lps in zip(requests, result.response_ids, result.logprobs):
        ref = full_forward_logprobs(model, r.prompt_ids, ids)
        assert torch.allclose(torch.tensor(lps, dtype=torch.float64), ref, atol=1e-4)
    exact = SpeculativeRollout(TransformersBackend(model, {1}, pad_id=0), rollout.cache, settings, [1], 64, "exact", 2)
    fresh = SpeculativeRollout(TransformersBackend(model, {1}, 0), RolloutCache(), settings, [1], 64, "vanilla", 2)
    assert exact.run(requests, step=2).response_ids == fresh.run(requests, step=2).response_ids


def test_the_paged_engine_refuses_a_sliding_model_with_an_advice_that_works():
    model = _model("mistral")
    with pytest.raises(ValueError, match="sliding-window attention.*--backend transformers"):
        PagedEngine(model, {1}, pad_id=0, num_blocks=16)
    TransformersBackend(model, {1}, pad_id=0)  # the advice: taken
