"""GRPO pieces: advantages, masks, loss; one training step; a 2-epoch end-to-end run."""

import json
import math

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

from spec_rl.acceptance.mode import MODES
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.trainer import GRPOConfig, GRPOTrainer, clipped_policy_loss, group_advantages, response_mask
from spec_rl.trainer.checkpoint import latest_checkpoint
from spec_rl.trainer.run import load_policy, run_modes


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
    expected = (
        -(
            min(ratio[0, 0], 1.0) * 1
            + min(ratio[0, 1] * 1, max(ratio[0, 1], 0.8) * 1)
            + min(-ratio[1, 0], -min(ratio[1, 0], 1.28))
        )
        / 3
    )
    assert loss.item() == pytest.approx(float(expected), rel=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    empty, _ = clipped_policy_loss(lp, old, adv, torch.zeros_like(mask))
    assert empty.item() == 0.0 and not math.isnan(empty.item())
    empty.backward()
    none, _ = clipped_policy_loss(
        torch.zeros(0, 0, requires_grad=True), torch.zeros(0, 0), torch.zeros(0), torch.zeros(0, 0, dtype=torch.bool)
    )
    assert none.item() == 0.0


def test_kl_term_needs_reference():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        clipped_policy_loss(lp, lp, torch.ones(1), torch.ones(1, 2, dtype=torch.bool), kl_coef=0.1)
    loss, m = clipped_policy_loss(
        lp,
        lp,
        torch.zeros(1),
        torch.ones(1, 2, dtype=torch.bool),
        kl_coef=0.1,
        ref_logprobs=torch.tensor([[-0.5, 0.2]]),
    )
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 0.2)]
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2, rel=1e-5)


class _Ex:
    def __init__(self, prompt, answer, uid):
        self.prompt, self.answer, self.uid = prompt, answer, uid


EXAMPLES = [
    _Ex(f"Question: Tom has {a} apples . Ann buys {b} more . how many now ? Answer:", str(a + b), f"t:{a}:{b}")
    for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]
]


def _reward(text: str, gold: str) -> float:
    # Rewards responses that contain the digit of the gold answer: some groups then have signal.
    return 1.0 if gold in text.split() else 0.0


def _config(**kw):
    base = dict(
        epochs=1,
        group_size=4,
        prompts_per_step=4,
        sampling=SamplingSettings(max_tokens=12),
        lr=1e-2,
        seed=0,
        save_checkpoint=False,
    )
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
    with pytest.raises(ValueError, match="^mode must be one of"):
        GRPOConfig(mode="fast")
    with pytest.raises(ValueError, match="^lenience"):
        GRPOConfig(mode=MODES["spec"].with_overrides(lenience=-1))
    with pytest.raises(ValueError, match="^group_size"):
        GRPOConfig(group_size=0)
    with pytest.raises(ValueError, match=r"modes: random-ref: mode must be one of vanilla, histspec, spec, exact"):
        run_modes(tmp_path / "policy", EXAMPLES, _reward, _config(), ["vanilla", "random-ref"], tmp_path / "run")
    with pytest.raises(ValueError, match=r"modes names a run twice: \['spec', 'spec'\]"):
        run_modes(tmp_path / "policy", EXAMPLES, _reward, _config(), ["spec", "spec"], tmp_path / "run")
    with pytest.raises(ValueError, match="modes is empty"):
        run_modes(tmp_path / "policy", EXAMPLES, _reward, _config(), [], tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.slow
def test_two_epoch_end_to_end_reuses_drafts_and_resumes(tmp_path):
    model_dir = tmp_path / "policy"
    tiny_model(seed=0).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    cfg = _config(epochs=2, lr=1e-3, save_checkpoint=True)
    assert MODES["spec"].rule.lenience == pytest.approx(math.exp(0.5))
    out = tmp_path / "run"
    summary = run_modes(model_dir, EXAMPLES, _reward, cfg, ["vanilla", "spec"], out, progress=False)
    spec, vanilla = summary["spec"], summary["vanilla"]
    assert [r["epoch"] for r in spec] == [1, 2]
    assert spec[0]["drafts_found"] == 0 and spec[0]["reused_tokens"] == 0
    assert spec[1]["drafts_found"] == 16 and spec[1]["reused_tokens"] > 0
    assert spec[1]["generated_tokens"] < vanilla[1]["generated_tokens"]
    assert vanilla[1]["reused_tokens"] == 0
    on_disk = json.loads((out / "summary.json").read_text())
    assert set(on_disk) == {"versions", "warnings", "runs"} and on_disk["runs"] == summary
    assert on_disk["versions"]["torch"] == torch.__version__ and "python" in on_disk["versions"]
    for key in (
        "epoch",
        "mean_reward",
        "generated_tokens",
        "reused_tokens",
        "full_reuse_ratio",
        "mean_verified_prefix",
        "rollout_seconds",
        "scoring_seconds",
    ):
        assert key in on_disk["runs"]["spec"][1]
    assert (out / "report.md").is_file() and (out / "report.png").stat().st_size > 1000
    ckpt = latest_checkpoint(out / "spec")  # the version LATEST names: a transformers checkpoint + trainer files
    assert ckpt.path.name == "checkpoint-2" and (ckpt.path / "config.json").is_file()
    assert (ckpt.path / "rollout_cache.safetensors").is_file()
    # Resume: a third epoch starts from the checkpoint and its cache (drafts found at once).
    cfg3 = _config(epochs=3, lr=1e-3, save_checkpoint=True)
    summary = run_modes(model_dir, EXAMPLES, _reward, cfg3, ["spec"], out, progress=False, resume=True)
    assert [r["epoch"] for r in summary["spec"]] == [1, 2, 3]
    assert summary["spec"][2]["drafts_found"] == 16


def test_paged_backend_in_the_trainer_splices_without_reprefill(tmp_path):
    from spec_rl.backends.paged import PagedEngine

    cfg = _config(epochs=2, lr=1e-4, generation_backend="paged")
    trainer = GRPOTrainer(tiny_model(seed=0), tiny_tokenizer(), EXAMPLES, _reward, cfg, tmp_path, progress=False)
    assert isinstance(trainer.rollout.backend, PagedEngine)
    first = trainer.train_step(range(4), epoch=0)
    second = trainer.train_step(range(4), epoch=1)
    assert first["drafts_found"] == 0
    assert second["drafts_found"] == 16 and second["reused_tokens"] > 0
    # Drafted rows continue from the spliced KV: no accepted token is prefilled again.
    assert second["reprefill_tokens"] == 0
    with pytest.raises(ValueError, match="generation_backend"):
        GRPOConfig(generation_backend="sglang")
    try:
        import vllm  # noqa: F401
    except (
        ImportError
    ):  # the main venv: a clear error naming what to install (tests/integrations/test_vllm_engine.py runs it)
        with pytest.raises(ImportError, match="generation_backend='vllm' needs vLLM"):
            GRPOTrainer(
                tiny_model(seed=0),
                tiny_tokenizer(),
                EXAMPLES,
                _reward,
                _config(generation_backend="vllm"),
                tmp_path,
                progress=False,
            )
    auto = GRPOTrainer(tiny_model(seed=0), tiny_tokenizer(), EXAMPLES, _reward, _config(), tmp_path, progress=False)
    assert type(auto.rollout.backend).__name__ == "TransformersBackend"  # CPU default (see GRPOConfig)


# (field, bad value, error, the message must contain): every float is finite where it must be and in range; counts
# are integers (no float or bool coercion); the message starts with the field's name. The sampling settings and the
# mode check their own fields (tests/acceptance/test_api_arguments.py, tests/acceptance/test_mode.py).
BAD_CONFIG = [
    ("clip_high", float("nan"), ValueError, "clip_high must be a finite number >= 0, got nan"),
    ("clip_low", float("nan"), ValueError, "clip_low must be a finite number >= 0 and < 1, got nan"),
    ("clip_low", 1.0, ValueError, "clip_low must be a finite number >= 0 and < 1"),
    ("kl_coef", float("nan"), ValueError, "kl_coef must be a finite number >= 0, got nan (0 turns the KL term off)"),
    ("kl_coef", float("inf"), ValueError, "kl_coef must be a finite number >= 0"),
    ("lr", float("nan"), ValueError, "lr must be a finite number > 0 and <= 1, got nan"),
    ("lr", float("inf"), ValueError, "lr must be a finite number > 0 and <= 1, got inf"),
    ("lr", 2.0, ValueError, "lr must be a finite number > 0 and <= 1, got 2.0 (AdamW moves a weight by about lr"),
    ("weight_decay", float("nan"), ValueError, "weight_decay must be a finite number >= 0"),
    ("max_grad_norm", 0.0, ValueError, "max_grad_norm must be a number (inf allowed) > 0"),
    ("max_model_len", 0, ValueError, "max_model_len must be >= 2, got 0 (None: the model's max_position_embeddings)"),
    ("max_model_len", 8.7, TypeError, "max_model_len must be an integer, got float 8.7"),
    ("seed", 1.9, TypeError, "seed must be an integer, got float 1.9"),
    ("seed", 10**23, ValueError, "seed must be <= 18446744073709551615, got 100000000000000000000000"),
    ("seed", -(2**63) - 1, ValueError, "seed must be >= -9223372036854775808"),
    ("seed", None, TypeError, "seed must be an integer, got NoneType"),
    ("epochs", 2.0, TypeError, "epochs must be an integer, got float 2.0"),
    ("group_size", True, TypeError, "group_size must be an integer, got bool True"),
    ("group_size", 1, ValueError, "group_size must be >= 2, got 1 (GRPO compares the G samples of a prompt)"),
    ("eval_every", 0, ValueError, "eval_every must be >= 1, got 0"),
    ("save_checkpoint", 1, TypeError, "save_checkpoint must be True or False, got 1"),
    ("scale_adv_by_std", "yes", TypeError, "scale_adv_by_std must be True or False, got 'yes'"),
    ("device", "tpu9", ValueError, "device must be auto, cpu, cuda, cuda:<index> or mps, got 'tpu9'"),
    ("generation_backend", "sglang", ValueError, "generation_backend must be one of ('auto', 'transformers', "),
    ("mode", "fast", ValueError, "mode must be one of vanilla, histspec, spec, exact, coupled, random or l=<lenience>"),
    ("sampling", {"temperature": 0.5}, TypeError, "sampling must be a SamplingSettings, got dict"),
]


@pytest.mark.parametrize("field, value, error, message", BAD_CONFIG, ids=[f"{f}={v!r}" for f, v, _, _ in BAD_CONFIG])
def test_config_refuses_bad_values_naming_the_field(field, value, error, message):
    with pytest.raises(error) as info:
        GRPOConfig(**{field: value})
    assert message in str(info.value) and str(info.value).startswith(f"{field} ")


def test_config_to_dict_nests_the_mode_and_the_sampling_settings():
    cfg = GRPOConfig(mode=MODES["exact"], sampling=SamplingSettings(temperature=0.7, max_tokens=64))
    d = cfg.to_dict()
    assert d["mode"] == MODES["exact"].to_dict() and d["sampling"] == cfg.sampling.to_dict()
    assert d["sampling"]["max_tokens"] == 64 and d["mode"]["tail"] == 8
    json.dumps(d)  # what run_info.json holds
    assert GRPOConfig().sampling == SamplingSettings(max_tokens=1024)
    assert GRPOConfig(mode="exact").mode == MODES["exact"]  # a mode by name


def test_max_model_len_above_the_models_positions_is_refused(tmp_path):
    match = r"^max_model_len must be <= the model's max_position_embeddings \(128\), got 129"
    with pytest.raises(ValueError, match=match):
        GRPOTrainer(tiny_model(), tiny_tokenizer(), EXAMPLES, _reward, _config(max_model_len=129), tmp_path)


def test_resume_restores_records_and_drops_metrics_past_the_checkpoint(tmp_path):
    cfg = _config(epochs=2, lr=1e-3, save_checkpoint=True, prompts_per_step=2)
    first = GRPOTrainer(tiny_model(seed=0), tiny_tokenizer(), EXAMPLES, _reward, cfg, tmp_path, progress=False)
    records = first.train()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    # A killed third epoch: one more step listed, and a line cut short by the kill.
    redone = lines[-1].replace('"step": 3', '"step": 4')
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + redone + '\n{"mode": "sp')
    ckpt = latest_checkpoint(tmp_path)
    again = GRPOTrainer(load_policy(ckpt.path)[0], tiny_tokenizer(), EXAMPLES, _reward, cfg, tmp_path, progress=False)
    assert again.resume() and (again.step, again.start_epoch) == (4, 2) and again.records == records
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == lines
    assert again.train() == records  # nothing left to do: the records of the finished epochs
    # load_policy also takes the run directory and loads the version LATEST names.
    model, _ = load_policy(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), first.model.state_dict().values()))


def test_an_epoch_without_learning_signal_is_flagged_everywhere(model_dir, tmp_path, capsys):
    from spec_rl.trainer.report import closing_lines

    out = tmp_path / "run"
    summary = run_modes(
        model_dir, EXAMPLES, lambda t, g: 0.0, _config(epochs=2), ["vanilla", "spec"], out, progress=False
    )
    log = capsys.readouterr().out
    for label in ("vanilla", "spec"):
        assert [r["no_signal"] for r in summary[label]] == [True, True]
        assert summary[label][0]["groups"] == 4 and summary[label][0]["flat_groups"] == 4
        assert f"WARNING [{label}] epoch 1: no learning signal - all 4 groups have equal rewards" in log
    stored = json.loads((out / "summary.json").read_text())
    assert stored["warnings"][0].startswith("WARNING: vanilla: no learning signal in epoch(s) 1, 2 of 2")
    assert "**WARNING: spec: no learning signal" in (out / "report.md").read_text()
    lines = closing_lines(summary)
    assert lines[0].startswith("WARNING: vanilla") and lines[1].startswith("WARNING: spec")
    # an unchanged policy reuses every draft: its ratios say nothing about speed, and are withheld
    ratio_line = next(line for line in lines if line.startswith("spec/vanilla"))
    assert "ratios withheld: no learning signal in epoch(s) 2" in ratio_line and "generated tokens" not in ratio_line
    report = (out / "report.md").read_text()
    assert "| spec (no learning signal in epoch(s) 2) |" in report and "| spec | 2 (no learning signal) |" in report
    # a run with signal in some compared epochs: the ratio line is given, marked with the epochs without
    from spec_rl.trainer.report import run_ratios

    mixed = {k: [dict(r) for r in v] for k, v in summary.items()}
    extra = [dict(r, epoch=3, no_signal=False) for r in (mixed["vanilla"][-1], mixed["spec"][-1])]
    mixed["vanilla"].append(extra[0])
    mixed["spec"].append(extra[1])
    line = next(line for line in closing_lines(mixed) if line.startswith("spec/vanilla"))
    assert line.startswith("spec/vanilla, epochs 2+ (no learning signal in epoch(s) 2): generated tokens")
    assert [r for r in run_ratios(mixed) if r["mode"] == "spec"][0]["epochs"] == [2, 3]


def test_groups_with_signal_are_not_flagged(tmp_path):
    trainer = GRPOTrainer(tiny_model(), tiny_tokenizer(), EXAMPLES, _reward, _config(), tmp_path, progress=False)
    rewards = []
    trainer.reward_fn = lambda t, g: rewards.append(len(rewards) % 2) or float(len(rewards) % 2)
    rec = trainer.train_step(range(4), epoch=0)
    assert rec["groups"] == 4 and rec["flat_groups"] == 0


def test_the_exact_rule_reports_its_accepted_share_without_a_drift_it_does_not_measure():
    from spec_rl.trainer.report import _context_text

    assert _context_text({"accepted_share": 0.62, "reused_drift": None}) == (
        "at 62% of draft tokens accepted (drift not measured by this rule)"
    )
    assert "policy drift 0.0065 nats/token" in _context_text({"accepted_share": 0.84, "reused_drift": 0.0065})
