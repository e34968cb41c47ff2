"""The runs of the command line: --modes, the flags that change the selected runs' modes, and the defaults of the
demo (l = 1, without-draft draw) and of a user's model (the paper's e^0.5 for GRPO, e^0.15 for DAPO's clip-higher)."""

import json
import math

import pytest

from spec_rl.acceptance.mode import MODES, TRAINER_MODE, RolloutMode
from spec_rl.acceptance.rules import Lenient
from spec_rl.cli import UsageError, _config, _lenient_note, _modes, _one_line, build_parser
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.trainer.config import LR, PRESETS, GRPOConfig, demo_config, preset


def _args(*argv):
    return build_parser().parse_args(["train", *argv])


def test_the_demo_runs_l1_without_draft_and_a_users_model_the_residual_draw():
    demo = _modes(_args(), demo=True)
    assert list(demo) == list(PRESETS["demo"].runs) == ["vanilla", "spec", "exact", "histspec"]
    assert PRESETS["demo"].spec == Lenient(1.0, "without-draft")
    assert demo == {
        "vanilla": MODES["vanilla"],
        "spec": RolloutMode(Lenient(1.0, "without-draft")),
        "exact": MODES["exact"],
        "histspec": MODES["histspec"],
    }
    assert _modes(_args("--model", "m"), demo=False) == {"l=1-res": RolloutMode(Lenient(1.0, "residual"))}
    assert GRPOConfig().mode == RolloutMode(Lenient(1.0, "residual")) == RolloutMode.parse(TRAINER_MODE)
    assert MODES["spec"].rule == Lenient(math.exp(0.5), "policy")
    # the user's flags replace the defaults they name, the others stay
    assert _modes(_args("--rejection-draw", "policy"), demo=True)["spec"] == RolloutMode(Lenient(1.0, "policy"))
    assert _modes(_args("--lenience", "2"), demo=True)["spec"] == RolloutMode(Lenient(2.0, "without-draft"))
    flags = ("--lenience", "e^0.3", "--rejection-draw", "without-draft")
    mine = _modes(_args("--model", "m", "--modes", "spec", *flags), demo=False)
    assert mine["spec"] == RolloutMode(Lenient(math.exp(0.3), "without-draft"))
    assert _modes(_args("--lenience", "inf"), demo=True)["spec"].rule.lenience == math.inf


def test_clip_higher_takes_dapos_lenience_on_a_users_model_only():
    demo = _args("--clip-higher")
    assert _config(demo, demo=True).clip_high == 0.28
    assert _modes(demo, demo=True)["spec"] == RolloutMode(Lenient(1.0, "without-draft"))
    model = _args("--model", "m", "--clip-higher", "--modes", "spec")
    assert _config(model, demo=False).clip_high == 0.28
    assert _modes(model, demo=False)["spec"] == RolloutMode(Lenient(math.exp(0.15), "policy"))
    for demo_run in (True, False):
        args = _args("--model", "m", "--clip-higher", "--lenience", "1.5", "--modes", "spec")
        assert _modes(args, demo=demo_run)["spec"].rule.lenience == 1.5


def test_no_tail_turns_tail_speculation_off_in_the_runs_that_have_it():
    runs = _modes(_args("--modes", "vanilla,spec,exact,random,histspec", "--no-tail"), demo=True)
    assert [m.tail for m in runs.values()] == [0, 0, 0, 0, 8]  # histspec is tail speculation
    assert runs["spec"] == RolloutMode(Lenient(1.0, "without-draft"), tail=0)
    assert all(m.tail for m in _modes(_args(), demo=True).values() if m.reuses_drafts)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--modes", "exact", "--lenience", "2"],
            "--lenience applies to the runs spec; the selected runs (exact) have no "
            "such setting: drop --lenience, or add such a run to --modes",
        ),
        (["--modes", "vanilla,histspec,random", "--lenience", "inf"], "--lenience applies to the runs spec;"),
        (["--modes", "vanilla", "--no-tail"], "--no-tail applies to the runs spec, exact, random; the selected runs ("),
        (["--modes", "vanilla,histspec", "--no-tail"], "the selected runs (vanilla, histspec) have no such setting"),
        (
            ["--modes", "vanilla,exact", "--rejection-draw", "without-draft"],
            "--rejection-draw applies to the runs spec",
        ),
        (["--modes", "random", "--rejection-draw", "policy"], "drop --rejection-draw"),
        (
            ["--modes", "spec,exact,spec"],
            "--modes names a run twice: ['spec', 'exact', 'spec'] (each run has one folder)",
        ),
        (["--modes", "random-ref"], "--modes takes vanilla, histspec, spec, exact, random or l=<lenience>"),
        (["--modes", "auto"], "--modes takes vanilla, histspec, spec, exact, random or l=<lenience>"),
        (["--modes", " , "], "--modes is empty"),
        (["--modes", "vanilla", "--spec-tokens", "4"], "--spec-tokens sets the width of tail speculation, which none"),
        (["--modes", "spec", "--no-tail", "--spec-tokens", "4"], "drop --spec-tokens, or add a run with tail"),
    ],
)
def test_mode_flags_no_selected_run_has_and_bad_runs_are_refused(argv, message):
    with pytest.raises(UsageError) as err:
        _modes(_args(*argv), demo=True)
    assert message in str(err.value)
    assert err.value.code == 2


@pytest.mark.parametrize(
    "argv, runs",
    [
        (
            ["--modes", "spec,exact", "--lenience", "2"],
            {"spec": RolloutMode(Lenient(2.0, "without-draft")), "exact": MODES["exact"]},
        ),
        (
            ["--modes", "vanilla,exact", "--no-tail"],
            {"vanilla": MODES["vanilla"], "exact": RolloutMode(MODES["exact"].rule, tail=0)},
        ),
        (
            ["--modes", " random , spec "],
            {"random": MODES["random"], "spec": RolloutMode(Lenient(1.0, "without-draft"))},
        ),
        (["--modes", "histspec"], {"histspec": MODES["histspec"]}),
    ],
)
def test_mode_flags_some_selected_run_has_are_taken(argv, runs):
    assert _modes(_args(*argv), demo=True) == runs


@pytest.mark.parametrize(
    "argv",
    [
        ["--lenience", "often"],
        ["--lenience", "0"],
        ["--lenience", "-1"],
        ["--lenience", "nan"],
        ["--lenience", "auto"],
        ["--rejection-draw", "resid"],
        ["--spec-tokens", "0"],
        ["--no-spec"],
        ["--reuse", "random"],
        ["--compare"],
        ["--acceptance", "exact"],
        ["--history-spec"],
        ["--sibling-drafts"],
        ["--target-drift", "0.05"],
    ],
)
def test_bad_and_unknown_flags_are_refused_by_the_parser(argv):
    with pytest.raises(UsageError) as err:
        _args(*argv)
    assert argv[0] in str(err.value)


def test_the_demo_and_model_defaults_make_configs():
    demo = _config(_args(), demo=True)
    assert demo == preset("demo") == demo_config()
    assert demo.sampling.max_tokens == PRESETS["demo"].fields["max_tokens"] == 160 and demo.sampling.temperature == 1.0
    assert (demo.lr, demo.epochs, demo.group_size) == (1e-4, 5, 4)
    model = _config(_args("--model", "m", "--temperature", "0.7", "--max-response-len", "64"), demo=False)
    assert model.sampling.temperature == 0.7 and model.sampling.max_tokens == 64
    assert model == GRPOConfig(
        sampling=SamplingSettings(temperature=0.7, max_tokens=64)
    )  # a user's model: the defaults
    assert model.lr == LR == 1e-6 and model.group_size == 8
    assert _modes(_args("--spec-tokens", "3"), demo=True)["spec"].tail == 3
    assert demo_config(epochs=2).epochs == 2
    assert preset("model", SamplingSettings(top_p=0.9, max_tokens=7)).sampling == SamplingSettings(
        top_p=0.9, max_tokens=1024
    )  # the preset's budget replaces the settings' own


def test_resume_under_another_mode_is_refused_naming_the_run(tmp_path):
    from spec_rl.trainer.resume_check import ConfigChangeError, check_resume, run_fingerprint

    def fingerprint(**modes):
        return run_fingerprint(GRPOConfig(), modes, "m", [2], [], None)

    policy, without = RolloutMode(Lenient(1.0, "policy")), RolloutMode(Lenient(1.0, "without-draft"))
    stored = fingerprint(vanilla=MODES["vanilla"], spec=policy)
    (tmp_path / "run_info.json").write_text(json.dumps({"fingerprint": stored}))
    assert check_resume(tmp_path, fingerprint(vanilla=MODES["vanilla"], spec=policy), allow_change=False) == []
    # tail speculation changes decode steps, never a token: not compared
    assert (
        check_resume(
            tmp_path, fingerprint(vanilla=MODES["vanilla"], spec=RolloutMode(Lenient(1.0), tail=0)), allow_change=False
        )
        == []
    )
    with pytest.raises(ConfigChangeError) as err:
        check_resume(tmp_path, fingerprint(vanilla=MODES["vanilla"], spec=without), allow_change=False)
    assert [k for k, _, _ in err.value.changes] == ["mode:spec"]
    line = _one_line(err.value)
    assert "the mode of run spec: {" in line and "'rejection_draw': 'policy'" in line
    assert "'rejection_draw': 'without-draft'" in line
    (change,) = check_resume(tmp_path, fingerprint(vanilla=MODES["vanilla"], spec=without), allow_change=True)
    assert change["field"] == "mode:spec" and change["new"]["rejection_draw"] == "without-draft"


def test_resume_under_another_training_recipe_names_the_flag(tmp_path):
    from spec_rl.trainer.resume_check import ConfigChangeError, check_resume, run_fingerprint

    def fingerprint(**config):
        return run_fingerprint(GRPOConfig(**config), {"spec": MODES["spec"]}, "m", [2], [], None)

    (tmp_path / "run_info.json").write_text(json.dumps({"fingerprint": fingerprint(lr=1e-4)}))
    assert check_resume(tmp_path, fingerprint(lr=1e-4, epochs=9), allow_change=False) == []
    with pytest.raises(ConfigChangeError) as err:
        check_resume(tmp_path, fingerprint(lr=2e-4, group_size=4), allow_change=False)
    assert "(--group-size: 8 -> 4; --lr: 0.0001 -> 0.0002)" in _one_line(err.value)
    with pytest.raises(ConfigChangeError) as err:  # another held-out schedule would leave gaps read as the new one's
        check_resume(tmp_path, fingerprint(lr=1e-4, eval_every=2), allow_change=False)
    assert "(--eval-every: 1 -> 2)" in _one_line(err.value)


def test_the_demo_draw_follows_a_lenience_below_one():
    assert _modes(_args("--lenience", "0.5"), demo=True)["spec"] == RolloutMode(Lenient(0.5, "policy"))
    assert _modes(_args("--lenience", "2"), demo=True)["spec"] == RolloutMode(Lenient(2.0, "without-draft"))


def test_the_header_and_the_records_name_the_rule_only_where_a_run_uses_it():
    from spec_rl.trainer.records import epoch_record

    assert _lenient_note(_modes(_args(), demo=True)) == " | lenient acceptance at l = 1, rejection draw without-draft"
    assert _lenient_note(_modes(_args("--modes", "vanilla,histspec,exact"), demo=True)) == ""
    assert _lenient_note({"spec": MODES["spec"]}) == " | lenient acceptance at l = 1.649, rejection draw policy"
    step = {"num_samples": 4, "reward_sum": 2.0}
    spec = epoch_record(1, [step], "spec", RolloutMode(Lenient(1.0, "without-draft")))
    assert {k: spec[k] for k in ("mode", "acceptance", "lenience", "rejection_draw", "tail", "log_lenience")} == {
        "mode": "spec",
        "acceptance": "lenient",
        "lenience": 1.0,
        "rejection_draw": "without-draft",
        "tail": 8,
        "log_lenience": 0.0,
    }
    exact = epoch_record(1, [step], "exact", MODES["exact"])
    assert exact["acceptance"] == "exact" and "lenience" not in exact and "rejection_draw" not in exact
    assert epoch_record(1, [step], "vanilla", MODES["vanilla"])["acceptance"] is None
    assert "strategy" not in spec and "history_spec" not in spec
