"""Sliding-window models: read from the config as transformers applies it, refused where a padded decode batch
would count the window in cache columns (left padding, rolled-back holes) instead of tokens."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from spec_rl.backends.transformers_backend import TransformersBackend
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


def _model(cls, config):
    torch.manual_seed(0)
    return cls(config(**SMALL) if isinstance(config, type) else config).eval()


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
    model = _model(cls, config)
    assert model_sliding_window(model) == window
    if window is None:
        TransformersBackend(model, {1}, pad_id=0)  # taken
    else:
        with pytest.raises(ValueError, match=f"sliding-window attention \\(window {window} tokens\\).*VLLMBackend"):
            TransformersBackend(model, {1}, pad_id=0)
        assert not supports_tree_attention(model)


def test_model_without_a_config_has_no_window():
    assert model_sliding_window(torch.nn.Linear(2, 2)) is None
