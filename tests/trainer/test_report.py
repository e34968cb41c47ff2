"""Run reports compare runs on held-out numbers: console rows, closing lines, report.md and report.png."""

import json

from spec_rl.acceptance.mode import MODES
from spec_rl.trainer.config import GRPOConfig
from spec_rl.trainer.report import closing_lines, format_row, run_ratios, write_report
from spec_rl.trainer.run import run_configs


def _record(epoch, tokens, seconds, heldout=None, greedy=None, reward=0.3, start=None, mode="vanilla"):
    rec = {
        **MODES[mode].to_dict(),
        "epoch": epoch,
        "mode": mode,
        "mean_reward": reward,
        "generated_tokens": tokens,
        "decode_steps": tokens // 10,
        "rollout_seconds": seconds,
        "scoring_seconds": 0.1,
        "generation_seconds": seconds - 0.1,
        "other_seconds": 0.0,
        "reward_reused_whole": None,
        "count_reused_whole": 0,
        "reward_partly_reused": None,
        "count_partly_reused": 0,
        "reward_fresh": reward,
        "count_fresh": 16,
    }
    if heldout is not None:
        rec.update(heldout_reward=heldout, heldout_greedy_accuracy=greedy, heldout_prompts=8, heldout_seconds=0.5)
    if start is not None:
        rec.update(start_heldout_reward=start[0], start_heldout_greedy_accuracy=start[1], start_heldout_prompts=8)
    return rec


SUMMARY = {
    "vanilla": [_record(1, 1000, 2.0, 0.30, 0.50, start=(0.25, 0.60)), _record(2, 1000, 2.0, 0.40, 0.55)],
    "spec": [
        _record(1, 1000, 2.0, 0.30, 0.50, start=(0.25, 0.60), mode="spec"),
        _record(2, 200, 0.8, 0.35, 0.58, reward=0.5, mode="spec"),
    ],
}


def _runs(modes, **config) -> dict:
    """run_info.json's "runs": each run's config as run_modes writes it."""
    return {m: c.to_dict() for m, c in run_configs(GRPOConfig(**config), {m: MODES[m] for m in modes}).items()}


def test_closing_lines_compare_heldout_numbers_not_rollout_reward():
    lines = closing_lines(SUMMARY)
    assert lines[0] == (
        "vanilla: held-out reward 0.250 -> 0.400, greedy accuracy 0.600 -> 0.550 (epochs 0 -> 2, 8 held-out prompts)"
    )
    assert lines[1].startswith(
        "spec/vanilla, epochs 2+: generated tokens 0.20x, decode steps 0.20x, rollout time 0.40x"
    )
    assert "final held-out reward 0.350 (-0.050 vs vanilla), greedy accuracy 0.580 (+0.030)" in lines[1]
    spec = [r for r in run_ratios(SUMMARY) if r["mode"] == "spec"][0]
    assert spec["final_reward_minus_vanilla"] > 0 > spec["final_heldout_reward_minus_vanilla"]  # the bias, in numbers
    no_eval = {m: [{k: v for k, v in r.items() if "heldout" not in k} for r in recs] for m, recs in SUMMARY.items()}
    (line,) = closing_lines(no_eval)
    assert line.endswith("held-out: not evaluated (--no-eval, or no held-out set)")
    assert closing_lines({"spec": SUMMARY["spec"]}) == [
        "spec: held-out reward 0.250 -> 0.350, greedy accuracy 0.600 -> 0.580 (epochs 0 -> 2, 8 held-out prompts)"
    ]


def test_rows_show_dashes_for_what_was_not_measured():
    row = format_row("spec", {"epoch": 0, "heldout_reward": 0.25, "heldout_greedy_accuracy": 0.6})
    cells = [c.strip() for c in row.split("|")]
    assert cells[:4] == ["spec", "0", "0.250", "0.600"] and set(cells[4:]) == {"-"}


def test_report_has_the_warm_start_row_the_origin_table_and_the_heldout_panel(tmp_path):
    info = {
        "model": "m",
        "device": "cpu",
        "eval_prompts": 8,
        "versions": {"python": "3.11.7", "torch": "2.13.0"},
        "runs": _runs(["vanilla", "spec"], epochs=2, eval_samples=4),
    }
    for mode in SUMMARY:
        (tmp_path / mode).mkdir()
        steps = [
            {"step": i, "mean_reward": 0.3, "tokens_generated": 100, "decode_steps": 10, "rollout_seconds": 1.0}
            for i in range(2)
        ]
        (tmp_path / mode / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    out = write_report(tmp_path, SUMMARY, info)
    md = out["report"].read_text()
    assert (
        "runs: vanilla (no draft reuse, tail speculation off), spec (lenient acceptance at l = 1.649, rejection "
        "draw policy, tail speculation on)."
    ) in md
    assert "Versions: python 3.11.7, torch 2.13.0." in md
    assert "| vanilla | 0 | 0.250 | 0.600 | - |" in md and "| spec | 2 | 0.350 | 0.580 | - | - | - | 0.500 |" in md
    assert (
        "## Rollout reward by response origin" in md
        and "| spec | 2 | 0.500 | n/a (0) | n/a (0) | 0.500 (16) | 0.350 |" in md
    )
    assert "8 prompts not trained on, 4 fresh sample(s) each" in md and "after every epoch," in md
    assert "evaluated after the last epoch only" not in md
    assert "at a rejection from the current policy (the paper's rule)" in md  # spec draws leniently
    assert json.loads(out["summary"].read_text()) == {"versions": info["versions"], "warnings": [], "runs": SUMMARY}
    assert json.loads((tmp_path / "run_info.json").read_text()) == info
    info["runs"] = _runs(["vanilla", "exact", "histspec"], epochs=2, eval_samples=1)
    md = write_report(tmp_path, SUMMARY, info, plot_png=False)["report"].read_text()
    assert (
        "exact and histspec produce vanilla's responses token for token and, beside vanilla, are evaluated at the "
        "warm start and after the last epoch only."
    ) in md
    info["runs"] = _runs(["vanilla", "exact"], epochs=2, eval_samples=1)
    md = write_report(tmp_path, SUMMARY, info, plot_png=False)["report"].read_text()
    assert "exact produces vanilla's responses token for token and, beside vanilla, is evaluated" in md
    info["runs"] = _runs(["vanilla", "exact"], epochs=2, eval_samples=1, eval_every=2)
    md = write_report(tmp_path, SUMMARY, info, plot_png=False)["report"].read_text()
    assert "after every 2 epochs and after the last," in md
    assert "| spec | 0.200 | 0.200 | 0.400 |" in md and "| -0.050 | +0.030 |" in md
    assert "Lenient acceptance draws" not in md  # no lenient run among the runs: no paragraph about it
    info["runs"]["spec"] = GRPOConfig(mode="spec").to_dict()
    md = write_report(tmp_path, SUMMARY, info, plot_png=False)["report"].read_text()
    assert "at a rejection from the current policy (the paper's rule)" in md and "without the rejected" not in md
    info["runs"]["spec"] = GRPOConfig(mode="l=1-res").to_dict()
    md = write_report(tmp_path, SUMMARY, info, plot_png=False)["report"].read_text()
    assert "at a rejection from the residual max(0, p - q) of the draft's own policy q" in md
    info["runs"]["spec"]["mode"]["rejection_draw"] = "without-draft"
    md = write_report(tmp_path, SUMMARY, info, plot_png=False)["report"].read_text()
    assert "at a rejection from the current policy without the rejected draft token" in md and "paper's rule" not in md
    assert out["plot"].stat().st_size > 10_000


def test_the_heldout_note_names_the_epochs_a_lossless_run_was_evaluated_after_a_resume_extended_it():
    from spec_rl.trainer.report import _heldout_note

    info = {"eval_prompts": 8, "runs": _runs(["vanilla", "exact"], epochs=5, eval_samples=1)}
    assert info["runs"]["exact"]["eval_every"] == 5
    exact = [{"epoch": e, "heldout_reward": 0.3 if e in (3, 5) else None} for e in range(1, 6)]
    (note, _) = _heldout_note(info, {"exact": exact})
    assert (
        "exact produces vanilla's responses token for token and, beside vanilla, is evaluated at the warm start "
        "and after epochs 3 and 5 only." in note
    )
    (note, _) = _heldout_note(
        info, {"exact": [{"epoch": e, "heldout_reward": 0.3 if e == 5 else None} for e in range(1, 6)]}
    )
    assert "after the last epoch only." in note


def test_the_heldout_note_says_when_a_resume_changed_the_schedule():
    from spec_rl.trainer.report import _heldout_note

    info = {
        "eval_prompts": 8,
        "runs": _runs(["spec"], epochs=4, eval_samples=1, eval_every=2),
        "config_changes": [
            {"date": "d", "field": "lr", "old": 1, "new": 2},
            {"date": "d", "field": "eval_every", "old": 1, "new": 2},
        ],
    }
    (note, _) = _heldout_note(info)
    assert "after every 2 epochs and after the last (eval_every changed on resume: 1 -> 2; the tables show" in note
    del info["config_changes"]
    assert "changed on resume" not in _heldout_note(info)[0]


def test_read_summary_returns_the_runs_and_refuses_other_files(tmp_path):
    import pytest

    from spec_rl.trainer.rundir import RunDirError, read_summary

    assert read_summary(tmp_path) == {}  # no summary yet
    (tmp_path / "summary.json").write_text(json.dumps({"versions": {"torch": "x"}, "runs": SUMMARY}))
    assert read_summary(tmp_path) == SUMMARY
    for text, words in (
        (json.dumps(SUMMARY), "is not a run summary"),  # {label: records} without "runs"
        ("[1, 2]", "is not a run summary"),
        (json.dumps({"runs": {"spec": 3}}), "is not a run summary"),
        ("{not json", "is not readable JSON"),
    ):
        (tmp_path / "summary.json").write_text(text)
        with pytest.raises(RunDirError, match=words):
            read_summary(tmp_path)
