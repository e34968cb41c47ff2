"""A new backend is one file plus one line in BACKENDS: the trainer builds it by name and its rollouts are the
built-in backend's, token for token (keyed sampling)."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model, tiny_tokenizer
from toy_backend import FullForwardBackend

from spec_rl.acceptance.mode import MODES
from spec_rl.backends import BACKENDS
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.drafts.cache import RolloutCache
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.tasks.data import Example
from spec_rl.trainer import GRPOConfig, GRPOTrainer


@pytest.mark.parametrize("mode", ["spec", "exact"])
def test_a_backend_in_one_file_rolls_out_as_the_built_in_one(mode):
    requests = [RolloutRequest(p, s) for p in ([3, 11, 12, 13], [3, 15, 16]) for s in range(3)]
    settings = SamplingSettings(temperature=1.0, max_tokens=10)
    runs = []
    for backend in (TransformersBackend(tiny_model(seed=3), {1}, 0), FullForwardBackend(tiny_model(seed=3), {1}, 0)):
        rollout = SpeculativeRollout(backend, RolloutCache(), settings, [1], 64, MODES[mode].with_overrides(tail=0))
        runs.append([rollout.run(requests, 0), rollout.run(requests, 1)])
    for ours, theirs in zip(*runs):
        assert ours.response_ids == theirs.response_ids
        assert ours.verified_prefix_len == theirs.verified_prefix_len
    assert runs[1][1].stats.drafts_found == len(requests)


def test_the_trainer_builds_a_registered_backend_by_name(monkeypatch, tmp_path):
    monkeypatch.setitem(BACKENDS, "full-forward", "toy_backend:FullForwardBackend")
    text = "Question: Tom has {} apples . how many now ? Answer:"
    examples = [Example(text.format(a), str(a), f"t:{a}", "arith") for a in (2, 3)]
    config = GRPOConfig(
        epochs=2,
        group_size=2,
        prompts_per_step=2,
        micro_batch_size=4,
        lr=1e-4,
        max_model_len=64,
        eval_samples=1,
        sampling=SamplingSettings(max_tokens=6),
        generation_backend="full-forward",
        save_checkpoint=False,
    )
    trainer = GRPOTrainer(tiny_model(seed=0), tiny_tokenizer(), examples, lambda t, g: 1.0, config, tmp_path)
    assert isinstance(trainer.rollout.backend, FullForwardBackend)
    first = trainer.train_step(range(2), epoch=0)
    second = trainer.train_step(range(2), epoch=1)
    assert first["decode_steps"] > 0 and first["tokens_generated"] > 0  # counted by the backend's own stats
    assert second["drafts_found"] == 4 and second["reused_tokens"] > 0
