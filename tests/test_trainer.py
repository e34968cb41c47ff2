"""GRPO pieces: advantages, masks, loss; one training step; a 2-epoch end-to-end run."""

import json
import math

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

from spec_rl.trainer import GRPOConfig, GRPOTrainer, clipped_policy_loss, group_advantages, response_mask
from spec_rl.trainer.run import run_modes


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(r, 4)
    std = torch.tensor([1.0, 0, 0, 0]).std()
    assert torch.allclose(adv[:4], (torch.tensor([1.0, 0, 0, 0]) - 0.25) / (std + 1e-6))
    assert torch.equal(adv[4:], torch.zeros(4))  # all-equal group: no signal
    assert torch.allclose(group_advantages(r, 4, scale_by_std=False)[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)


def test_response_mask_includes_eos_and_excludes_what_follows():
    m = response_mask([[5, 6, 1, 7, 8], [5, 2], [5, 6, 7]], eos_ids={1, 2}, width=5)
    assert m.tolist() == [
        [True, True, True, False, False],
        [True, True, False, False, False],
        [True, True, True, False, False],
    ]


def test_clipped_loss_values_and_empty_batch():
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0], [-1.0, -0.1]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, True], [True, False]])
    loss, m = clipped_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    ratio = torch.exp(lp.detach() - old)
    expected = -(
        min(ratio[0, 0], 1.0) * 1
        + min(ratio[0, 1] * 1, max(ratio[0, 1], 0.8) * 1)
        + min(-ratio[1, 0], -min(ratio[1, 0], 1.28))
    ) / 3
    assert loss.item() == pytest.approx(float(expected), rel=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    empty, _ = clipped_policy_loss(lp, old, adv, torch.zeros_like(mask))
    assert empty.item() == 0.0 and not math.isnan(empty.item())
    empty.backward()
    none, _ = clipped_policy_loss(torch.zeros(0, 0, requires_grad=True), torch.zeros(0, 0), torch.zeros(0), torch.zeros(0, 0, dtype=torch.bool))
    assert none.item() == 0.0


def test_kl_term_needs_reference():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        clipped_policy_loss(lp, lp, torch.ones(1), torch.ones(1, 2, dtype=torch.bool), kl_coef=0.1)
    loss, m = clipped_policy_loss(lp, lp, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), kl_coef=0.1,
                                  ref_logprobs=torch.tensor([[-0.5, 0.2]]))
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 0.2)]
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2, rel=1e-5)


class _Ex:
    def __init__(self, prompt, answer, uid):
        self.prompt, self.answer, self.uid = prompt, answer, uid


EXAMPLES = [_Ex(f"Question: Tom has {a} apples . Ann buys {b} more . how many now ? Answer:", str(a + b), f"t:{a}:{b}")
            for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]


def _reward(text: str, gold: str) -> float:
    # Rewards responses that contain the digit of the gold answer: some groups then have signal.
    return 1.0 if gold in text.split() else 0.0


def _config(**kw):
    base = dict(epochs=1, group_size=4, prompts_per_step=4, max_response_len=12, lr=1e-2, seed=0, save_checkpoint=False)
    base.update(kw)
    return GRPOConfig(**base)


def test_one_step_changes_the_weights(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model(seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = GRPOTrainer(model, tok, EXAMPLES, lambda t, g: float(len(t) % 2), _config(), tmp_path, progress=False)
    rec = trainer.train_step(range(4), epoch=1)
    changed = sum(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert changed > 0
    assert rec["num_samples"] == 16 and 0 <= rec["mean_reward"] <= 1
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_all_zero_advantages_give_no_update(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model(seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = GRPOTrainer(model, tok, EXAMPLES, lambda t, g: 1.0, _config(), tmp_path, progress=False)
    rec = trainer.train_step(range(4), epoch=1)
    assert rec["loss"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bad_trainer_input(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        GRPOTrainer(tiny_model(), tiny_tokenizer(), [], _reward, _config(), tmp_path)
    with pytest.raises(ValueError, match="mode"):
        GRPOConfig(mode="fast")
    with pytest.raises(ValueError, match="lenience"):
        GRPOConfig(lenience=-1)
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=0)


@pytest.mark.slow
def test_two_epoch_end_to_end_reuses_drafts_and_resumes(tmp_path):
    model_dir = tmp_path / "policy"
    tiny_model(seed=0).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    cfg = _config(epochs=2, lr=1e-3, lenience=math.exp(0.5), save_checkpoint=True)
    out = tmp_path / "run"
    summary = run_modes(model_dir, EXAMPLES, _reward, cfg, ["vanilla", "spec"], out, progress=False, log=lambda s: None)
    spec, vanilla = summary["spec"], summary["vanilla"]
    assert [r["epoch"] for r in spec] == [1, 2]
    assert spec[0]["drafts_found"] == 0 and spec[0]["reused_tokens"] == 0
    assert spec[1]["drafts_found"] == 16 and spec[1]["reused_tokens"] > 0
    assert spec[1]["generated_tokens"] < vanilla[1]["generated_tokens"]
    assert vanilla[1]["reused_tokens"] == 0
    on_disk = json.loads((out / "summary.json").read_text())
    for key in ("epoch", "mean_reward", "generated_tokens", "reused_tokens", "full_reuse_ratio", "mean_verified_prefix",
                "rollout_seconds", "scoring_seconds"):
        assert key in on_disk["spec"][1]
    assert (out / "report.md").is_file() and (out / "report.png").stat().st_size > 1000
    assert (out / "spec" / "checkpoint" / "config.json").is_file()
    assert (out / "spec" / "rollout_cache.safetensors").is_file()
    # Resume: a third epoch starts from the checkpoint and its cache (drafts found at once).
    cfg3 = _config(epochs=3, lr=1e-3, lenience=math.exp(0.5), save_checkpoint=True)
    summary = run_modes(model_dir, EXAMPLES, _reward, cfg3, ["spec"], out, progress=False, resume=True, log=lambda s: None)
    assert [r["epoch"] for r in summary["spec"]] == [1, 2, 3]
    assert summary["spec"][2]["drafts_found"] == 16


def test_paged_backend_in_the_trainer_splices_without_reprefill(tmp_path):
    from spec_rl.engine import PagedEngine

    cfg = _config(epochs=2, lr=1e-4, generation_backend="paged")
    trainer = GRPOTrainer(tiny_model(seed=0), tiny_tokenizer(), EXAMPLES, _reward, cfg, tmp_path, progress=False)
    assert isinstance(trainer.rollout.backend, PagedEngine)
    first = trainer.train_step(range(4), epoch=1)
    second = trainer.train_step(range(4), epoch=2)
    assert first["drafts_found"] == 0
    assert second["drafts_found"] == 16 and second["reused_tokens"] > 0
    # Drafted rows continue from the spliced KV: no accepted token is prefilled again.
    assert second["reprefill_tokens"] == 0
    with pytest.raises(ValueError, match="generation_backend"):
        GRPOConfig(generation_backend="vllm")
    auto = GRPOTrainer(tiny_model(seed=0), tiny_tokenizer(), EXAMPLES, _reward, _config(), tmp_path, progress=False)
    assert type(auto.rollout.backend).__name__ == "TransformersBackend"  # CPU default (see GRPOConfig)
