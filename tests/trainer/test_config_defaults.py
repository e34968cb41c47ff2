"""Lenience defaults per algorithm (paper App. A.1), adaptive lenience and random-ref in the trainer config and CLI."""

import math

import pytest

from spec_rl.cli import _config, build_parser
from spec_rl.cli_modes import chosen_runs
from spec_rl.trainer.config import MODE_PRESETS, ConfigError, GRPOConfig


def test_the_paper_default_follows_the_algorithm_unless_a_lenience_is_given():
    assert GRPOConfig().lenience == pytest.approx(math.exp(0.5))
    dapo = GRPOConfig(algorithm="dapo")
    assert dapo.lenience == pytest.approx(math.exp(0.15))
    assert dapo.to_dict()["lenience_source"] == "paper default for DAPO (App. A.1)"
    assert GRPOConfig(algorithm="ppo").lenience == pytest.approx(math.exp(0.3))
    given = GRPOConfig(algorithm="dapo", lenience=2.0)
    assert given.lenience == 2.0 and given.to_dict()["lenience_source"] == "given"
    with pytest.raises(ConfigError, match="algorithm"):
        GRPOConfig(algorithm="reinforce")


def test_cli_clip_higher_takes_dapos_lenience_and_records_why():
    args = build_parser().parse_args(["train", "--clip-higher"])
    cfg = _config(args, demo=True)
    assert cfg.clip_high == 0.28 and cfg.lenience == pytest.approx(math.exp(0.15))
    assert "DAPO" in cfg.to_dict()["lenience_source"]
    args = build_parser().parse_args(["train", "--clip-higher", "--lenience", "1.5"])
    assert _config(args, demo=True).lenience == 1.5


def test_auto_lenience_and_random_ref_are_runs_of_their_own():
    args = build_parser().parse_args(["train", "--lenience", "auto", "--target-drift", "0.05"])
    cfg = _config(args, demo=True)
    assert cfg.lenience == "auto" and cfg.target_drift == 0.05 and cfg.to_dict()["log_lenience"] == "auto"
    assert MODE_PRESETS["auto"]["lenience"] == "auto"
    assert GRPOConfig(mode="random-ref").rollout_strategy == "random-ref"
    args = build_parser().parse_args(["train", "--reuse", "random-ref", "--no-compare"])
    assert chosen_runs(args, demo=True) == ["random-ref"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--lenience", "often"])
    with pytest.raises(ConfigError, match="target_drift"):
        GRPOConfig(lenience="auto", target_drift=0.0)


def test_the_demo_runs_l1_without_draft_and_a_users_model_the_papers_rule():
    from spec_rl.cli_modes import UsageError
    from spec_rl.trainer.run import mode_configs

    demo = _config(build_parser().parse_args(["train"]), demo=True)
    assert demo.lenience == 1.0 and demo.rejection_draw == "without-draft" and "6 seeds" in demo.to_dict()["lenience_source"]
    model = _config(build_parser().parse_args(["train", "--model", "m"]), demo=False)
    assert model.lenience == pytest.approx(math.exp(0.5)) and model.rejection_draw == "policy"
    paper = _config(build_parser().parse_args(["train", "--rejection-draw", "policy"]), demo=True)
    assert paper.rejection_draw == "policy"
    # the demo's rule is the pair (l = 1, without-draft): a lenience or algorithm of the user's gets the paper's draw
    for argv in (["--acceptance", "exact"], ["--lenience", "2"], ["--lenience", "0"], ["--clip-higher"]):
        assert _config(build_parser().parse_args(["train", *argv]), demo=True).rejection_draw == "policy", argv
    # the demo's own lenience, given explicitly, is still the demo's rule (a resume that repeats it changes nothing)
    assert _config(build_parser().parse_args(["train", "--lenience", "1"]), demo=True).rejection_draw == "without-draft"
    mine = _config(build_parser().parse_args(["train", "--lenience", "2", "--rejection-draw", "without-draft"]), demo=True)
    assert mine.lenience == 2.0 and mine.rejection_draw == "without-draft"
    auto = build_parser().parse_args(["train", "--modes", "vanilla,auto", "--rejection-draw", "without-draft"])
    assert chosen_runs(auto, demo=True) == ["vanilla", "auto"]
    # each run of the demo: only the lenient spec run draws without the draft token
    runs = mode_configs(demo, ["vanilla", "spec", "exact", "histspec", "random"])
    assert {m: c.rejection_draw for m, c in runs.items()} == {
        "vanilla": "policy", "spec": "without-draft", "exact": "policy", "histspec": "policy", "random": "policy"}
    for argv in (["--rejection-draw", "without-draft", "--modes", "vanilla,exact"], ["--rejection-draw", "policy", "--no-spec"],
                 ["--rejection-draw", "without-draft", "--acceptance", "exact"], ["--rejection-draw", "policy", "--reuse", "random"]):
        with pytest.raises(UsageError, match="--rejection-draw applies to lenient SPEC-RL runs .* drop --rejection-draw"):
            chosen_runs(build_parser().parse_args(["train", *argv]), demo=True)
    with pytest.raises(ConfigError, match="needs lenience >= 1"):
        _config(build_parser().parse_args(["train", "--lenience", "0.5", "--rejection-draw", "without-draft"]), demo=True)
    with pytest.raises(UsageError, match="invalid choice"):
        build_parser().parse_args(["train", "--rejection-draw", "residual"])


def test_resume_under_another_rejection_draw_is_refused(tmp_path):
    import json

    from spec_rl.trainer.resume_check import ConfigChangeError, check_resume, run_fingerprint

    def fingerprint(draw):
        return run_fingerprint(GRPOConfig(lenience=1.0, rejection_draw=draw), "m", [2], [], None)

    (tmp_path / "run_info.json").write_text(json.dumps({"fingerprint": fingerprint("policy")}))
    assert check_resume(tmp_path, fingerprint("policy"), allow_change=False) == []
    with pytest.raises(ConfigChangeError, match="rejection_draw: 'policy' -> 'without-draft'"):
        check_resume(tmp_path, fingerprint("without-draft"), allow_change=False)
    (change,) = check_resume(tmp_path, fingerprint("without-draft"), allow_change=True)
    assert change["field"] == "rejection_draw" and change["new"] == "without-draft"


def test_resume_under_another_eval_schedule_is_refused_by_its_flag(tmp_path):
    import json

    from spec_rl.cli import _one_line
    from spec_rl.trainer.resume_check import ConfigChangeError, check_resume, run_fingerprint

    def fingerprint(every):
        return run_fingerprint(GRPOConfig(eval_every=every), "m", [2], [], None)

    (tmp_path / "run_info.json").write_text(json.dumps({"fingerprint": fingerprint(1)}))
    assert check_resume(tmp_path, fingerprint(1), allow_change=False) == []
    with pytest.raises(ConfigChangeError) as err:
        check_resume(tmp_path, fingerprint(2), allow_change=False)
    assert "--eval-every: 1 -> 2" in _one_line(err.value)
    old = json.loads((tmp_path / "run_info.json").read_text())["fingerprint"]
    del old["eval_every"]  # a run stored before eval_every was compared resumes as before
    (tmp_path / "run_info.json").write_text(json.dumps({"fingerprint": old}))
    assert check_resume(tmp_path, fingerprint(2), allow_change=False) == []


def test_the_header_and_the_records_name_the_draw_only_where_a_run_uses_it():
    from spec_rl.cli import _draw_note
    from spec_rl.trainer.records import epoch_record

    demo = _config(build_parser().parse_args(["train"]), demo=True)
    assert _draw_note(demo, ["vanilla", "spec", "exact", "histspec"]) == " (rejection draw: without-draft)"
    assert _draw_note(demo, ["vanilla", "auto"]) == " (rejection draw: without-draft)"
    assert _draw_note(demo, ["vanilla", "histspec"]) == "" and _draw_note(GRPOConfig(), ["spec"]) == ""
    step = {"num_samples": 4, "reward_sum": 2.0}
    assert epoch_record(1, [step], "spec", 1.0, "lenient", "without-draft")["rejection_draw"] == "without-draft"
    assert epoch_record(1, [step], "exact", 1.0, "exact")["rejection_draw"] == "policy"


@pytest.mark.parametrize("argv, message", [
    (["--lenience", "0", "--reuse", "random"], r"--lenience 0 is vanilla GRPO \(no reuse\), so --reuse random would be ignored"),
    (["--no-spec", "--compare"], "the selected run is plain vanilla .* so --compare would be ignored"),
    (["--no-spec", "--lenience", "2"], r"--lenience 2.0 applies to lenient SPEC-RL runs \(spec\), and the selected runs \(vanilla\)"),
    (["--modes", "exact", "--lenience", "2"], "--lenience 2.0 applies to lenient SPEC-RL runs"),
    (["--modes", "exact", "--lenience", "auto"], r"--lenience auto applies to lenient SPEC-RL runs \(spec, auto\)"),
    (["--modes", "auto", "--lenience", "2"], "auto adapts its own"),
    (["--modes", "vanilla,histspec,random", "--lenience", "inf"], "--lenience inf applies"),
    (["--modes", "vanilla", "--spec-tokens", "4"], "so --spec-tokens would be ignored; drop it, or run histspec"),
    (["--modes", "vanilla", "--history-spec"], "so --history-spec would be ignored"),
])  # fmt: skip
def test_flags_the_chosen_runs_would_ignore_are_refused(argv, message):
    from spec_rl.cli_modes import UsageError

    with pytest.raises(UsageError, match=message):
        chosen_runs(build_parser().parse_args(["train", *argv]), demo=True)


@pytest.mark.parametrize("argv, runs", [
    (["--modes", "spec,exact", "--lenience", "2"], ["spec", "exact"]),
    (["--modes", "exact", "--lenience", "1"], ["exact"]),  # 1 is "not set" for exact, as in the adapters
    (["--modes", "auto", "--lenience", "auto"], ["auto"]),
    (["--modes", "vanilla,histspec", "--spec-tokens", "4"], ["vanilla", "histspec"]),
    (["--reuse", "random", "--no-compare"], ["random"]),
    (["--lenience", "0"], ["vanilla"]),
])  # fmt: skip
def test_flags_the_chosen_runs_use_are_taken(argv, runs):
    assert chosen_runs(build_parser().parse_args(["train", *argv]), demo=True) == runs
