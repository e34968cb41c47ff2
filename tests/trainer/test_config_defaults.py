"""The runs of the command line: --modes (every name one mode, as everywhere else), the tail flags that change the
selected runs, the names the settings moved into, and the defaults of the demo and of a user's model."""

import json
import math

import pytest

from spec_rl.acceptance.mode import MODES, TRAINER_MODE, RolloutMode
from spec_rl.acceptance.rules import Lenient
from spec_rl.cli import UsageError, _config, _lenient_note, _modes, _one_line, build_parser
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.trainer.config import LR, PRESETS, GRPOConfig, RunSetting, preset, run_settings
from spec_rl.trainer.sweep import DEMO_SETTINGS, MODEL_SETTINGS


def _args(*argv):
    return build_parser().parse_args(["train", *argv])


def _mode_runs(argv, demo=True):
    return {m: r.mode for m, r in _modes(_args(*argv), demo=demo).items()}


def test_the_demo_runs_l1_without_draft_and_a_users_model_its_default():
    demo = _mode_runs([])
    assert list(demo) == list(PRESETS["demo"].runs) == ["vanilla", "l=1-excl", "exact", "histspec"]
    assert demo == {name: RolloutMode.parse(name) for name in PRESETS["demo"].runs}
    assert demo["l=1-excl"] == RolloutMode(Lenient(1.0, "without-draft"))
    assert _mode_runs(["--model", "m"], demo=False) == {TRAINER_MODE: RolloutMode.parse(TRAINER_MODE)}
    assert GRPOConfig().mode == RolloutMode.parse(TRAINER_MODE)
    assert MODES["spec"].rule == Lenient(math.exp(0.5), "policy")


NAMES = ["vanilla", "histspec", "spec", "exact", "coupled", "random", "l=1", "l=e^0.3-excl", "l=1-res", "spec-age2"]


@pytest.mark.parametrize("demo", [True, False])
def test_every_name_means_one_mode_in_the_cli_the_api_and_the_sweep(demo):
    names = NAMES + [n + "+tis" for n in NAMES if RolloutMode.parse(n).reuses_drafts] + ["l=2+mis:3"]
    cli = _modes(_args("--modes", ",".join(names)), demo=demo)
    assert cli == run_settings(names) == {n: RunSetting.parse(n) for n in names}
    for name in names:
        mode, _, _ = name.partition("+")
        assert cli[name].mode == RolloutMode.parse(mode)
    for name in (*DEMO_SETTINGS, *MODEL_SETTINGS, *PRESETS["demo"].runs, *PRESETS["model"].runs):
        mode, _, _ = name.partition("+")
        assert RunSetting.parse(name).mode == RolloutMode.parse(mode)


def test_clip_higher_changes_the_clip_only():
    for demo in (True, False):
        args = _args("--model", "m", "--clip-higher", "--modes", "spec")
        assert _config(args, demo=demo).clip_high == 0.28
        assert _mode_runs(["--model", "m", "--clip-higher", "--modes", "spec"], demo)["spec"] == MODES["spec"]


def test_no_tail_turns_tail_speculation_off_in_the_runs_that_have_it():
    runs = _mode_runs(["--modes", "vanilla,spec,exact,random,histspec", "--no-tail"])
    assert [m.tail for m in runs.values()] == [0, 0, 0, 0, 8]  # histspec is tail speculation
    assert runs["spec"] == RolloutMode(MODES["spec"].rule, tail=0)
    assert all(m.tail for m in _mode_runs([]).values() if m.reuses_drafts)
    assert _mode_runs(["--modes", "histspec,exact", "--spec-tokens", "3"]) == {
        "histspec": RolloutMode(None, tail=3),
        "exact": RolloutMode(MODES["exact"].rule, tail=3),
    }


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lenience", "2"], "--lenience is part of a run's name now: name the run in --modes as l=<lenience>"),
        (["--rejection-draw", "policy"], "--rejection-draw is part of a run's name now"),
        (["--max-draft-age", "2"], "name the run in --modes as <mode>-age<N> (e.g. spec-age2)"),
        (["--modes", "vanilla", "--no-tail"], "--no-tail sets the width of tail speculation in the runs that have it"),
        (["--modes", "vanilla,histspec", "--no-tail"], "none of the selected runs (vanilla, histspec) does"),
        (["--modes", "spec,exact,spec"], "--modes names a run twice: ['spec', 'exact', 'spec'] (each run has one"),
        (["--modes", "random-ref"], "--modes: random-ref: mode must be one of vanilla, histspec, spec, exact, coupled"),
        (["--modes", "auto"], "--modes: auto: mode must be one of"),
        (["--modes", "vanilla+tis"], "vanilla reuses no drafts, so there is nothing to correct"),
        (["--modes", " , "], "--modes is empty"),
        (["--modes", "vanilla", "--spec-tokens", "4"], "--spec-tokens sets the width of tail speculation"),
    ],
)
def test_bad_runs_and_flags_are_refused_naming_the_fix(argv, message):
    with pytest.raises(UsageError) as err:
        _modes(_args(*argv), demo=True)
    assert message in str(err.value)
    assert err.value.code == 2


def test_a_mode_refuses_a_setting_it_does_not_have():
    assert MODES["histspec"].with_overrides(tail=4).tail == 4
    with pytest.raises(ValueError, match=r"lenience: this mode \(no draft reuse"):
        MODES["vanilla"].with_overrides(lenience=2)
    with pytest.raises(ValueError, match="tail: this mode"):
        MODES["vanilla"].with_overrides(tail=4)
    assert MODES["spec"].with_overrides(lenience=2.0, max_draft_age=3) == RolloutMode(Lenient(2.0), max_draft_age=3)


@pytest.mark.parametrize(
    "argv",
    [
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
    assert demo == preset("demo")
    assert demo.sampling.max_tokens == PRESETS["demo"].fields["max_tokens"] == 160 and demo.sampling.temperature == 1.0
    assert (demo.lr, demo.epochs, demo.group_size) == (1e-4, 5, 4)
    model = _config(_args("--model", "m", "--temperature", "0.7", "--max-response-len", "64"), demo=False)
    assert model.sampling.temperature == 0.7 and model.sampling.max_tokens == 64
    assert model == GRPOConfig(
        sampling=SamplingSettings(temperature=0.7, max_tokens=64)
    )  # a user's model: the defaults
    assert model.lr == LR == 1e-6 and model.group_size == 8
    assert _mode_runs(["--spec-tokens", "3"])["l=1-excl"].tail == 3
    assert preset("demo", epochs=2).epochs == 2
    assert preset("model", SamplingSettings(top_p=0.9, max_tokens=7)).sampling == SamplingSettings(
        top_p=0.9, max_tokens=1024
    )  # the preset's budget replaces the settings' own


def test_resume_under_another_mode_is_refused_naming_the_run(tmp_path):
    from spec_rl.trainer.resume_check import ConfigChangeError, check_resume, run_fingerprint

    def fingerprint(**modes):
        return run_fingerprint(GRPOConfig(), {k: GRPOConfig(mode=m) for k, m in modes.items()}, "m", [2], [], None)

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
        cfg = GRPOConfig(**config)
        return run_fingerprint(cfg, {"spec": GRPOConfig(**config, mode=MODES["spec"])}, "m", [2], [], None)

    (tmp_path / "run_info.json").write_text(json.dumps({"fingerprint": fingerprint(lr=1e-4)}))
    assert check_resume(tmp_path, fingerprint(lr=1e-4, epochs=9), allow_change=False) == []
    with pytest.raises(ConfigChangeError) as err:
        check_resume(tmp_path, fingerprint(lr=2e-4, group_size=4), allow_change=False)
    assert "(--group-size: 8 -> 4; --lr: 0.0001 -> 0.0002)" in _one_line(err.value)
    with pytest.raises(ConfigChangeError) as err:  # another held-out schedule would leave gaps read as the new one's
        check_resume(tmp_path, fingerprint(lr=1e-4, eval_every=2), allow_change=False)
    assert "(--eval-every: 1 -> 2)" in _one_line(err.value)


def test_the_header_and_the_records_name_the_rule_only_where_a_run_uses_it():
    from spec_rl.trainer.records import epoch_record

    assert _lenient_note(_modes(_args(), demo=True)) == " | lenient acceptance at l = 1, rejection draw without-draft"
    assert _lenient_note(_modes(_args("--modes", "vanilla,histspec,exact"), demo=True)) == ""
    spec = {"spec": RunSetting(MODES["spec"])}
    assert _lenient_note(spec) == " | lenient acceptance at l = 1.649, rejection draw policy"
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
