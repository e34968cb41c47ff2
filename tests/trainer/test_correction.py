"""Rollout correction in the trainer (docs/design.md "Rollout correction"): its names, weights and statistics, the
weighted loss, and a run that reports them."""

import math

import pytest
import torch
from test_trainer import EXAMPLES, _config, _reward
from tiny_models import tiny_model, tiny_tokenizer

from spec_rl.acceptance.mode import MODES
from spec_rl.trainer import GRPOConfig, clipped_policy_loss
from spec_rl.trainer.config import RunSetting, run_settings
from spec_rl.trainer.correction import RolloutCorrection, weight_stats, weight_sums
from spec_rl.trainer.run import run_modes


def test_names_parse_and_bad_ones_are_refused():
    assert RolloutCorrection.parse("tis") == RolloutCorrection("tis", 2.0)
    assert RolloutCorrection.parse("mis:5") == RolloutCorrection("mis", 5.0)
    assert RolloutCorrection.parse("none") is None and RolloutCorrection.parse(None) is None
    assert RolloutCorrection("mis", 5.0).name == "mis:5" and RolloutCorrection().name == "tis"
    for bad, message in [("seq", "must be none, tis, mis"), ("tis:x", "finite number"), ("tis:1", "threshold must be")]:
        with pytest.raises(ValueError, match=message):
            RolloutCorrection.parse(bad)
    run = RunSetting.parse("l=1-age2+mis:3")
    assert run.mode.rule.lenience == 1.0 and run.mode.max_draft_age == 2 and run.correction.threshold == 3.0
    assert RunSetting.parse("spec") == RunSetting(MODES["spec"], None)
    with pytest.raises(ValueError, match="nothing to correct"):
        RunSetting.parse("vanilla+tis")
    with pytest.raises(ValueError, match="names no correction"):
        RunSetting.parse("spec+none")
    with pytest.raises(ValueError, match=r"modes: spec\+foo: rollout_correction must be"):
        run_settings(["vanilla", "spec+foo"])
    assert GRPOConfig(rollout_correction="mis:4").to_dict()["rollout_correction"] == "mis:4"


def test_weights_truncate_or_mask_and_their_statistics():
    log_w = torch.log(torch.tensor([[1.0, 3.0, 0.5, 9.0], [1.0, 1.0, 2.5, 1.0]]))
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    w, kept = RolloutCorrection("tis", 2.0).weights(log_w, mask)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 0.5, 0.0], [1.0, 1.0, 2.0, 1.0]]))
    assert torch.equal(kept, mask)
    w, kept = RolloutCorrection("mis", 2.0).weights(log_w, mask)
    assert torch.allclose(w, torch.tensor([[1.0, 0.0, 0.5, 0.0], [1.0, 1.0, 0.0, 1.0]]))
    assert kept.tolist() == [[True, False, True, False], [True, True, False, True]]
    sums = weight_sums(log_w, mask, RolloutCorrection("tis", 2.0))
    values = torch.tensor([1.0, 3.0, 0.5, 1.0, 1.0, 2.5, 1.0], dtype=torch.float64)
    stats = weight_stats([sums])
    assert stats["is_mean"] == pytest.approx(float(values.mean()))
    assert stats["is_max"] == pytest.approx(3.0) and stats["is_corrected_share"] == pytest.approx(2 / 7)
    assert stats["is_ess"] == pytest.approx(float(values.sum() ** 2 / (7 * (values**2).sum())))
    assert weight_stats([])["is_mean"] is None


def test_weight_stats_add_steps_and_take_the_largest_weight_of_those_that_weighed_tokens():
    gen = torch.Generator().manual_seed(3)
    masks = [torch.rand(3, 5, generator=gen) < 0.7 for _ in range(4)]
    log_ws = [-0.1 - 2 * torch.rand(3, 5, generator=gen) for _ in range(4)]  # every weight below 1
    masks[2][:] = False  # a step that weighed no token
    steps = [weight_sums(lw, m, None) for lw, m in zip(log_ws, masks)]
    w = torch.cat([lw.double().exp()[m] for lw, m in zip(log_ws, masks)])
    stats = weight_stats([*steps, {}, {"is_tokens": 0, "is_max": None}])
    assert stats["is_mean"] == pytest.approx(float(w.mean()), rel=1e-12)
    assert stats["is_max"] == pytest.approx(float(w.max()), rel=1e-12) and float(w.max()) < 1.0
    assert stats["is_ess"] == pytest.approx(float(w.sum() ** 2 / (w.numel() * (w**2).sum())), rel=1e-12)
    epochs = [weight_stats(steps[:2]) | {"is_tokens": steps[0]["is_tokens"] + steps[1]["is_tokens"]}]
    assert weight_stats(epochs)["is_max"] == max(steps[0]["is_max"], steps[1]["is_max"])


def test_the_loss_weighs_each_tokens_surrogate():
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.0], [-0.4, -0.1]])
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 2, dtype=torch.bool)
    w = torch.tensor([[2.0, 0.5], [1.0, 0.0]])
    plain, _ = clipped_policy_loss(lp, old, adv, mask, 0.2, 0.2)
    weighted, _ = clipped_policy_loss(lp, old, adv, mask, 0.2, 0.2, is_weights=w)
    ratio = torch.exp(lp.detach() - old)
    surrogate = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    assert weighted.item() == pytest.approx(float((surrogate * w).sum() / 4), rel=1e-6)
    assert plain.item() == pytest.approx(float(surrogate.sum() / 4), rel=1e-6)


@pytest.mark.slow
def test_a_corrected_run_reports_weights_one_without_reuse_and_past_one_with_it(tmp_path):
    model_dir = tmp_path / "policy"
    tiny_model(seed=0).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    cfg = _config(epochs=2, lr=3e-2)
    summary = run_modes(model_dir, EXAMPLES, _reward, cfg, ["vanilla", "spec+tis"], tmp_path / "run", progress=False)
    first, second = summary["spec+tis"]
    assert first["is_mean"] == 1.0 and first["is_max"] == 1.0 and first["is_ess"] == 1.0  # nothing reused yet
    assert second["reused_tokens"] > 0 and second["is_max"] > 1.0 and second["is_ess"] < 1.0
    assert all(r["is_mean"] == 1.0 and r["is_corrected_share"] == 0.0 for r in summary["vanilla"])
    report = (tmp_path / "run" / "report.md").read_text()
    assert "IS weight mean" in report and "IS ESS" in report
    assert math.isfinite(second["is_mean"])
