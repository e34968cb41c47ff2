"""`spec-rl train` on a local checkpoint and real GSM8K-format data."""

import json
import os
from pathlib import Path

import pytest
from repo_paths import SHARED_DATA

from spec_rl.cli import main

SHARED = SHARED_DATA


@pytest.mark.skipif(not (SHARED / "gsm8k_test.jsonl").is_file(), reason="shared GSM8K file not present")
def test_train_on_local_model_and_gsm8k_file(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "--model",
            str(model_dir),
            "--data",
            str(SHARED / "gsm8k_test.jsonl"),
            "--limit",
            "4",
            "--epochs",
            "2",
            "--group-size",
            "2",
            "--prompts-per-step",
            "4",
            "--max-response-len",
            "8",
            "--max-model-len",
            "128",
            "--out",
            str(out),
            "--no-progress",
            "--modes",
            "vanilla,spec",
            "--no-checkpoint",
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())["runs"]
    assert set(summary) == {"vanilla", "spec"}
    assert summary["spec"][1]["drafts_found"] == 8
    printed = capsys.readouterr().out
    # the math reward never pays the tiny random policy: no learning signal, the ratio line says so instead
    assert "reward" in printed and "spec/vanilla, epochs 2+: ratios withheld: no learning signal" in printed


def test_bad_cli_input(tmp_path, model_dir, capsys):
    # Bad input: one "spec-rl: error: ..." line and exit status 2 (argparse's convention), no traceback.
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "train",
                "--model",
                str(tmp_path / "nope"),
                "--data",
                str(tmp_path / "x.jsonl"),
                "--no-progress",
                "--out",
                str(tmp_path / "r"),
            ]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("spec-rl: error: --model") and "config.json" in err
    with pytest.raises(SystemExit, match="--data"):
        main(["train", "--model", str(model_dir), "--no-progress"])
    with pytest.raises(SystemExit):
        main(["train", "--lenience", "-1"])
    with pytest.raises(SystemExit, match="--modes"):
        main(["train", "--model", str(model_dir), "--data", "x", "--modes", "fast"])


def test_debug_shows_the_traceback_of_a_bad_input(tmp_path, capsys):
    argv = ["train", "--model", str(tmp_path / "nope"), "--data", str(tmp_path / "x.jsonl"), "--no-progress"]
    with pytest.raises(SystemExit):
        main(argv)
    assert capsys.readouterr().err.startswith("spec-rl: error: --model")
    with pytest.raises(FileNotFoundError, match="not a transformers checkpoint directory"):  # the exception itself
        main(["--debug", *argv])
    assert "spec-rl: error:" not in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a flag of the command, before the subcommand only
        main([*argv, "--debug"])


def _error_line(capsys, argv) -> str:
    """Run the CLI, expect exit status 2 and exactly one stderr line "spec-rl: error: ..."; return that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("spec-rl: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(
            json.dumps({"question": f"Tom has {a} apples . Ann buys {b} more . how many ?", "answer": f"#### {a + b}"})
            + "\n"
            for a, b in [(1, 2), (3, 4)]
        )
    )
    return path


def _train_argv(model_dir, data_file, out, *extra):
    return [
        "train",
        "--model",
        str(model_dir),
        "--data",
        str(data_file),
        "--out",
        str(out),
        "--epochs",
        "1",
        "--group-size",
        "2",
        "--prompts-per-step",
        "2",
        "--max-response-len",
        "4",
        "--modes",
        "vanilla",
        "--no-progress",
        *extra,
    ]


# (flags, what the one error line must contain): the flag at fault and what it must be.
BAD_FLAGS = [
    (["--clip-high", "nan"], ["--clip-high must be a finite number >= 0", "got nan"]),
    (["--clip-low", "nan"], ["--clip-low must be a finite number >= 0 and < 1", "got nan"]),
    (["--clip-low", "1"], ["--clip-low must be a finite number >= 0 and < 1", "got 1.0"]),
    (["--kl-coef", "nan"], ["--kl-coef must be a finite number >= 0", "0 turns the KL term off"]),
    (["--kl-coef", "inf"], ["--kl-coef must be a finite number >= 0", "got inf"]),
    (["--lr", "nan"], ["--lr must be a finite number > 0", "got nan"]),
    (["--lr", "0"], ["--lr must be a finite number > 0"]),
    (["--lr", "1e300"], ["--lr must be a finite number > 0 and <= 1", "AdamW moves a weight by about lr a step"]),
    (["--modes", "l=1_0"], ["--modes: l=1_0: mode must be one of"]),
    (["--temperature", "nan"], ["--temperature must be a finite number > 0", "greedy decoding"]),
    (["--temperature", "0"], ["--temperature must be a finite number > 0", "got 0.0"]),
    (["--top-p", "1.5"], ["--top-p must be a finite number > 0 and <= 1", "got 1.5", "1.0 to disable"]),
    (["--top-k", "-1"], ["--top-k must be >= 0, got -1", "0 to disable top-k"]),
    (["--max-response-len", "0"], ["--max-response-len must be >= 1, got 0"]),
    (["--max-model-len", "0"], ["--max-model-len must be >= 2", "None: the model's max_posit", "got 0"]),
    (["--max-model-len", "-5"], ["--max-model-len must be >= 2", "got -5"]),
    (["--max-model-len", "100000"], ["--max-model-len must be <= the model's max_position_embeddings (128)", "100000"]),
    (["--seed", "1e23"], ["argument --seed: invalid int value: '1e23'", "--help"]),
    (["--seed", "abc"], ["argument --seed: invalid int value: 'abc'"]),
    (["--seed", str(10**23)], ["--seed must be <= 18446744073709551615"]),
    (["--limit", "0"], ["argument --limit: must be an integer >= 1", "'0'"]),
    (["--device", "tpu9"], ["--device must be auto, cpu, cuda, cuda:<index> or mps", "'tpu9'"]),
    (["--modes", "histspec", "--spec-tokens", "0"], ["argument --spec-tokens: must be an integer >= 1, got '0'"]),
    (["--spec-tokens", "-1"], ["argument --spec-tokens: must be an integer >= 1, got '-1'"]),
    (["--epochs", "0"], ["--epochs must be >= 1, got 0"]),
    # --modes chooses the runs, each name one mode; the tail flags change the selected runs that have tail
    # speculation, and one that no selected run has is refused, not ignored (here the runs are vanilla)
    (["--lenience", "2"], ["--lenience is part of a run's name now: name the run in --modes as l=<lenience>"]),
    (["--modes", "exact", "--lenience", "2"], ["--lenience is part of a run's name now"]),
    (["--no-tail"], ["--no-tail sets the width of tail speculation in the runs that have it, and none of the"]),
    (["--modes", "vanilla,histspec", "--no-tail"], ["none of the selected runs (vanilla, histspec) does"]),
    (["--rejection-draw", "policy"], ["--rejection-draw is part of a run's name now", "l=1-res (residual)"]),
    (["--modes", "vanilla,vanilla"], ["--modes names a run twice: ['vanilla', 'vanilla'] (each run has one folder)"]),
    (
        ["--modes", "vanilla,random-ref"],
        ["--modes: random-ref: mode must be one of vanilla, histspec, spec, exact, coupled, random", "'random-ref'"],
    ),
    (["--modes", "auto"], ["--modes: auto: mode must be one of vanilla, histspec, spec, exact, coupled, random or l="]),
    (["--max-draft-age", "2"], ["--max-draft-age is part of a run's name now", "spec-age2"]),
    (["--modes", "l=2-res"], ["rejection_draw 'residual' needs lenience 1, got 2"]),
    (["--modes", ","], ["--modes is empty: name at least one run (e.g. vanilla,spec)"]),
    (["--modes", "l=0.5-excl"], ["rejection_draw 'without-draft' needs lenience >= 1, got 0.5"]),
    (["--modes", "spec+tis:1"], ["--modes: spec+tis:1: rollout_correction 'tis:1': the threshold must be a finite"]),
    (["--modes", "spec", "--rollout-correction", "clip"], ["--rollout-correction must be none, tis, mis"]),
    (["--modes", "spec", "--rollout-correction", "tis:-2"], ["--rollout-correction 'tis:-2': the threshold must be"]),
    # flags that contradict each other are refused, not one of them dropped
    (["--clip-higher", "--clip-high", "0.5"], ["--clip-higher sets --clip-high to 0.28 (DAPO): pass one of them"]),
    (["--system-prompt", "x", "--chat-template", "off"], ["--system-prompt is a message of the chat template"]),
    (["--modes", "spec", "--no-tail", "--spec-tokens", "3"], ["--no-tail turns tail speculation off and --spec-"]),
    (["--cache-dir", "somewhere"], ["--cache-dir is where the demo policy is cached; --model needs none"]),
]


@pytest.mark.parametrize("flags, expected", BAD_FLAGS, ids=[" ".join(flags) for flags, _ in BAD_FLAGS])
def test_bad_flag_values_give_one_line_naming_the_flag(flags, expected, model_dir, data_file, tmp_path, capsys):
    line = _error_line(capsys, _train_argv(model_dir, data_file, tmp_path / "run", *flags))
    for text in expected:
        assert text in line, line
    assert not (tmp_path / "run" / "vanilla" / "metrics.jsonl").exists()  # refused before training


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the machine has CUDA")
def test_cuda_device_on_a_cpu_machine(model_dir, data_file, tmp_path, capsys):
    line = _error_line(capsys, _train_argv(model_dir, data_file, tmp_path / "run", "--device", "cuda"))
    assert "--device is 'cuda' but this machine has no CUDA device; use auto or cpu" in line


def test_out_must_be_a_writable_folder(model_dir, data_file, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    line = _error_line(capsys, _train_argv(model_dir, data_file, a_file))
    assert f"--out {a_file} is a file, not a folder" in line and a_file.read_text() == "mine"
    line = _error_line(capsys, _train_argv(model_dir, data_file, a_file / "run"))
    assert f"--out {a_file / 'run'}: cannot create the folder (Not a directory); choose a writable place" in line
    if os.geteuid() == 0:  # root writes anywhere it has permission bits for; /sys refuses new folders
        unwritable = Path("/sys/spec-rl-run")
        if not Path("/sys").is_dir():
            pytest.skip("no /sys to test an unwritable --out as root")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        unwritable = locked / "run"
    line = _error_line(capsys, _train_argv(model_dir, data_file, unwritable))
    assert f"--out {unwritable}: cannot create the folder (" in line and "choose a writable place" in line


def test_existing_run_is_refused_without_resume_and_kept(model_dir, data_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_train_argv(model_dir, data_file, out)) == 0
    capsys.readouterr()
    metrics = (out / "vanilla" / "metrics.jsonl").read_text()
    line = _error_line(capsys, _train_argv(model_dir, data_file, out, "--epochs", "2"))
    assert f"--out {out} already holds a run (" in line and "pass --resume to continue it, or a fresh --out" in line
    assert (out / "vanilla" / "metrics.jsonl").read_text() == metrics and (out / "vanilla" / "checkpoint-1").is_dir()
    # --modes spec into the same folder is refused too (it would drop vanilla's results).
    _error_line(capsys, _train_argv(model_dir, data_file, out, "--modes", "spec"))


def test_resume_needs_a_run_and_a_checkpoint(model_dir, data_file, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    line = _error_line(capsys, _train_argv(model_dir, data_file, tmp_path / "empty", "--resume"))
    assert "holds no run to resume" in line and "drop --resume" in line
    missing = tmp_path / "new" / "deeper"
    line = _error_line(capsys, _train_argv(model_dir, data_file, missing, "--resume"))
    assert line.endswith(f"--resume: {missing} does not exist; drop --resume to start a new run there")
    assert not (tmp_path / "new").exists()  # nothing created for a run that is not there
    argv = [a for a in _train_argv(model_dir, data_file, tmp_path, "--resume") if a not in (str(tmp_path), "--out")]
    assert _error_line(capsys, argv).endswith("--resume needs --out DIR, the run directory to continue")
    out = tmp_path / "run"
    assert main(_train_argv(model_dir, data_file, out, "--no-checkpoint")) == 0
    line = _error_line(capsys, _train_argv(model_dir, data_file, out, "--resume", "--epochs", "2"))
    assert "vanilla has 1 finished epoch(s) in summary.json but no complete checkpoint" in line
    assert "--no-checkpoint" in line and "fresh --out" in line


def test_resume_with_another_budget_is_refused_or_continues_without_cut_responses(
    model_dir, data_file, tmp_path, capsys
):
    from spec_rl.drafts.cache import RolloutCache
    from spec_rl.trainer.checkpoint import CACHE_FILE, latest_checkpoint
    from spec_rl.trainer.run import policy_eos_ids

    out = tmp_path / "run"
    assert main(_train_argv(model_dir, data_file, out, "--modes", "spec")) == 0  # budget 4
    capsys.readouterr()
    longer = ["--modes", "spec", "--epochs", "3", "--max-response-len", "12", "--resume"]
    line = _error_line(capsys, _train_argv(model_dir, data_file, out, *longer))
    assert "the sampling settings (--temperature, --top-p, --top-k, --max-response-len): " in line
    assert "'max_tokens': 4} -> {" in line and "'max_tokens': 12}" in line
    assert "--allow-config-change" in line and "fresh --out" in line
    assert len(json.loads((out / "summary.json").read_text())["runs"]["spec"]) == 1  # nothing was touched
    assert main(_train_argv(model_dir, data_file, out, *longer, "--allow-config-change")) == 0
    said = capsys.readouterr().out
    assert "--allow-config-change: sampling {" in said and "'max_tokens': 12} (recorded in run_info.json)" in said
    info = json.loads((out / "run_info.json").read_text())
    assert [(c["field"], c["old"]["max_tokens"], c["new"]["max_tokens"]) for c in info["config_changes"]] == [
        ("sampling", 4, 12)
    ]
    assert info["fingerprint"]["sampling"]["max_tokens"] == 12
    # The responses of the resumed epochs (the drafts stored at the end): none is cut short by the old budget.
    cache = RolloutCache.load(latest_checkpoint(out / "spec").path / CACHE_FILE)
    eos = policy_eos_ids(model_dir)
    drafts = cache.drafts()
    assert drafts and all(d.token_ids[-1].item() in eos or len(d) == 12 for d in drafts)
    assert any(len(d) > 4 for d in drafts)
    # the same command again: the run is complete, nothing is done
    assert main(_train_argv(model_dir, data_file, out, *longer)) == 0
    assert "is complete (3 epochs of spec); nothing to do" in capsys.readouterr().out
    line = _error_line(capsys, _train_argv(model_dir, data_file, tmp_path / "new", "--allow-config-change"))
    assert "--allow-config-change applies to --resume only" in line


def test_limit_applies_to_the_demo_train_set():
    from spec_rl.cli import _load_examples, build_parser

    args = build_parser().parse_args(["train", "--limit", "5"])
    assert len(_load_examples(args, demo=True)) == 5
    args = build_parser().parse_args(["train"])
    assert len(_load_examples(args, demo=True)) == 256


def test_resume_with_a_subset_of_modes_keeps_the_others(model_dir, data_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_train_argv(model_dir, data_file, out, "--modes", "vanilla,spec")) == 0
    spec = json.loads((out / "summary.json").read_text())["runs"]["spec"]
    assert main(_train_argv(model_dir, data_file, out, "--modes", "vanilla", "--epochs", "2", "--resume")) == 0
    summary = json.loads((out / "summary.json").read_text())["runs"]
    assert summary["spec"] == spec and [r["epoch"] for r in summary["vanilla"]] == [1, 2]
    runs = json.loads((out / "run_info.json").read_text())["runs"]
    assert list(runs) == ["vanilla", "spec"] and runs["vanilla"]["epochs"] == 2 and runs["spec"]["epochs"] == 1
    assert "[vanilla] resumed at epoch 2" in capsys.readouterr().out
    steps = [json.loads(x)["step"] for x in (out / "vanilla" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
    assert main(_train_argv(model_dir, data_file, out, "--modes", "vanilla,spec", "--epochs", "2", "--resume")) == 0
    said = capsys.readouterr().out
    assert "[vanilla] finished earlier: all 2 epochs are in" in said and "[spec] resumed at epoch 2" in said


def test_a_run_left_out_of_a_resume_keeps_its_mode_for_the_next_one(model_dir, data_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_train_argv(model_dir, data_file, out, "--modes", "vanilla,spec")) == 0
    assert main(_train_argv(model_dir, data_file, out, "--modes", "vanilla", "--epochs", "2", "--resume")) == 0
    assert "mode:spec" in json.loads((out / "run_info.json").read_text())["fingerprint"]
    other = ("--modes", "spec", "--epochs", "2", "--resume", "--rollout-correction", "tis")  # another run of spec
    with pytest.raises(SystemExit):
        main(_train_argv(model_dir, data_file, out, *other))
    assert "the mode of run spec" in capsys.readouterr().err


# Held-out flags: (extra flags, what the one error line must contain). "EVAL" is replaced by a held-out file.
BAD_EVAL_FLAGS = [
    (["--eval-fraction", "0"], "argument --eval-fraction: must be a number in (0, 1), got '0'"),
    (["--eval-fraction", "1"], "argument --eval-fraction: must be a number in (0, 1), got '1'"),
    (["--eval-fraction", "nan"], "argument --eval-fraction: must be a number in (0, 1)"),
    (["--eval-fraction", "half"], "argument --eval-fraction: must be a number in (0, 1), got 'half'"),
    (["--eval-samples", "0", "--eval-fraction", "0.5"], "--eval-samples must be >= 1, got 0"),
    (["--eval-samples", "2.5"], "argument --eval-samples: invalid int value: '2.5'"),
    (["--eval-every", "0", "--eval-fraction", "0.5"], "--eval-every must be >= 1, got 0"),
    (["--eval-data", "EVAL", "--eval-fraction", "0.5"], "pass either --eval-data or --eval-fraction, not both"),
    (["--no-eval", "--eval-data", "EVAL"], "--no-eval turns held-out evaluation off; drop --eval-data"),
    (["--no-eval", "--eval-samples", "2"], "--no-eval turns held-out evaluation off; drop --eval-samples"),
    (["--no-eval", "--eval-every", "2"], "--no-eval turns held-out evaluation off; drop --eval-every"),
    (["--eval-every", "2"], "--eval-every needs a held-out set: pass --eval-data FILE or --eval-fraction F"),
    (["--eval-samples", "2"], "--eval-samples needs a held-out set: pass --eval-data FILE or --eval-fraction F"),
    (["--eval-data", "MISSING"], "MISSING"),
    (["--limit", "1", "--eval-fraction", "0.5"], "--eval-fraction 0.5: 1 distinct prompt(s) cannot be split"),
]


@pytest.mark.parametrize("flags, expected", BAD_EVAL_FLAGS, ids=[" ".join(f) for f, _ in BAD_EVAL_FLAGS])
def test_bad_heldout_flags_give_one_line(flags, expected, model_dir, data_file, tmp_path, capsys):
    names = {"EVAL": str(data_file), "MISSING": str(tmp_path / "missing.jsonl")}
    flags = [names.get(f, f) for f in flags]
    line = _error_line(capsys, _train_argv(model_dir, data_file, tmp_path / "run", *flags))
    assert names.get(expected, expected) in line, line
    assert not (tmp_path / "run" / "vanilla" / "metrics.jsonl").exists()


def test_demo_refuses_heldout_files(capsys):
    line = _error_line(capsys, ["train", "--eval-fraction", "0.2", "--no-progress"])
    assert "--eval-data and --eval-fraction need --model: the demo evaluates on its own held-out set" in line


def test_eval_fraction_and_eval_data_evaluate_every_epoch(model_dir, data_file, tmp_path, capsys):
    out = tmp_path / "frac"
    assert (
        main(
            _train_argv(
                model_dir,
                data_file,
                out,
                "--eval-fraction",
                "0.5",
                "--eval-samples",
                "2",
                "--modes",
                "vanilla,spec",
                "--epochs",
                "2",
            )
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())["runs"]
    info = json.loads((out / "run_info.json").read_text())
    assert info["train_prompts"] == 1 and info["eval_prompts"] == 1
    assert {m: c["eval_samples"] for m, c in info["runs"].items()} == {"vanilla": 2, "spec": 2}
    for mode in ("vanilla", "spec"):
        assert all("heldout_reward" in r and "heldout_greedy_accuracy" in r for r in summary[mode])
        assert "start_heldout_reward" in summary[mode][0]
    # spec reuses vanilla's warm-start evaluation; the time stays with the run that spent it
    assert "start_heldout_seconds" in summary["vanilla"][0] and "start_heldout_seconds" not in summary["spec"][0]
    printed = capsys.readouterr().out
    assert "held-out: 1 prompts x 2 sample(s) + greedy" in printed
    assert "vanilla: held-out reward" in printed and "final held-out reward" in printed
    report = (out / "report.md").read_text()
    assert "| held-out |" in report and "1 prompts not trained on, 2 fresh sample(s) each" in report
    out = tmp_path / "file"
    assert main(_train_argv(model_dir, data_file, out, "--eval-data", str(data_file))) == 0
    assert json.loads((out / "run_info.json").read_text())["eval_prompts"] == 2
    assert "2 --eval-data prompt(s) are also training prompts" in capsys.readouterr().err
    out = tmp_path / "off"
    assert main(_train_argv(model_dir, data_file, out, "--no-eval")) == 0
    assert "heldout_reward" not in json.loads((out / "summary.json").read_text())["runs"]["vanilla"][0]


def test_vllm_backend_without_vllm_is_refused_before_the_run(model_dir, data_file, tmp_path, capsys):
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401

        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    line = _error_line(capsys, _train_argv(model_dir, data_file, tmp_path / "run", "--backend", "vllm"))
    assert "--backend vllm needs vLLM installed" in line
    assert not (tmp_path / "run").exists()  # nothing written


def test_the_header_line_states_the_policy_parameter_count(model_dir, data_file, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from spec_rl.trainer.run import count_parameters

    expected = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    assert count_parameters(model_dir) == expected and count_parameters(tmp_path) is None
    assert main(_train_argv(model_dir, data_file, tmp_path / "run", "--no-eval")) == 0
    assert f"policy: {expected:,} parameters" in capsys.readouterr().out


def test_resume_under_another_training_recipe_is_refused_even_when_the_run_is_complete(
    model_dir, data_file, tmp_path, capsys
):
    out = tmp_path / "run"
    assert main(_train_argv(model_dir, data_file, out)) == 0  # 1 epoch of vanilla: complete
    capsys.readouterr()
    lr = json.loads((out / "run_info.json").read_text())["fingerprint"]["lr"]
    for flags, shown in (
        (["--lr", "5e-4"], f"--lr: {lr!r} -> 0.0005"),
        (["--kl-coef", "0.1"], "--kl-coef: 0.0 -> 0.1"),
    ):
        line = _error_line(capsys, _train_argv(model_dir, data_file, out, "--resume", *flags))
        assert shown in line and "how the policy is trained" in line and "--allow-config-change" in line
    assert json.loads((out / "run_info.json").read_text())["config_changes"] == []  # nothing was touched


def test_a_group_of_one_is_refused(model_dir, data_file, tmp_path, capsys):
    line = _error_line(capsys, _train_argv(model_dir, data_file, tmp_path / "run", "--group-size", "1"))
    assert line.startswith("spec-rl: error: --group-size must be >= 2, got 1") and "the G samples of a prompt" in line


def test_prompt_format_and_reward_flags(model_dir, data_file, tmp_path, capsys):
    line = _error_line(capsys, _train_argv(model_dir, data_file, tmp_path / "r1", "--chat-template", "on"))
    assert "--chat-template is 'on' but the tokenizer has no chat template; use 'auto' or 'off'" in line
    line = _error_line(capsys, _train_argv(model_dir, data_file, tmp_path / "r2", "--reward", "gsm"))
    assert "--reward: invalid choice: 'gsm' (choose from 'arithmetic', 'math', 'format', 'math+format')" in line
    line = _error_line(capsys, _train_argv(model_dir, data_file, tmp_path / "r3", "--eval-limit", "2"))
    assert "--eval-limit cuts --eval-data or the demo's held-out set" in line
    line = _error_line(capsys, ["train", "--data", str(data_file), "--no-progress"])
    assert "--data needs --model" in line


def test_a_user_model_trains_on_the_demo_task(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    argv = _train_argv(model_dir, "demo", out, "--limit", "2", "--eval-limit", "3", "--reward", "math+format")
    assert main(argv) == 0
    info = json.loads((out / "run_info.json").read_text())
    assert info["train_prompts"] == 2 and info["eval_prompts"] == 3
    assert info["runs"]["vanilla"]["prompt_format"] == {"chat_template": "auto", "system_prompt": None}


def test_a_folder_without_a_tokenizer_or_a_budget_past_the_context_is_refused_before_anything_is_written(
    model_dir, data_file, tmp_path, capsys
):
    import shutil

    bare = tmp_path / "weights-only"
    shutil.copytree(model_dir, bare)
    for f in bare.iterdir():
        if "token" in f.name or f.name in ("vocab.json", "merges.txt", "special_tokens_map.json"):
            f.unlink()
    out = tmp_path / "run"
    line = _error_line(capsys, _train_argv(bare, data_file, out))
    assert f"--model {bare} has no tokenizer (none of tokenizer.json, tokenizer_config.json" in line
    assert "tokenizer.save_pretrained" in line and not out.exists()
    no_weights = tmp_path / "config-and-tokenizer"
    shutil.copytree(model_dir, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    line = _error_line(capsys, _train_argv(no_weights, data_file, out, "--max-response-len", "8"))
    assert f"--model {no_weights} has no weights (no *.safetensors" in line and not out.exists()
    # the tiny model has 128 positions: a budget of 128 (or past it) leaves no room for a prompt
    line = _error_line(capsys, _train_argv(model_dir, data_file, out, "--max-response-len", "10000"))
    assert line.endswith(
        "--max-response-len must be < the context (max_position_embeddings) of 128 tokens (a prompt and its response "
        "share it), got 10000: responses would be cut to fit silently"
    )
    line = _error_line(
        capsys, _train_argv(model_dir, data_file, out, "--max-model-len", "64", "--max-response-len", "64")
    )
    assert "--max-response-len must be < the max_model_len of 64 tokens" in line
    assert not out.exists()


def test_a_resume_under_another_model_records_the_model_that_trained(model_dir, data_file, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    assert main(_train_argv(model_dir, data_file, out, "--modes", "spec")) == 0
    other = tmp_path / "other-model"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "eos_token_id": [1, 2]}))  # another EOS set: not used
    argv = _train_argv(other, data_file, out, "--modes", "spec", "--epochs", "2", "--resume")
    assert "(--model: " in _error_line(capsys, argv)  # refused without --allow-config-change
    assert main([*argv, "--allow-config-change"]) == 0
    assert f"trained from {model_dir}; --model is not used" in capsys.readouterr().out
    info = json.loads((out / "run_info.json").read_text())
    assert info["model"] == info["fingerprint"]["model"] == str(model_dir)  # what trained, not the new --model
    assert [(c["field"], c["old"], c["new"]) for c in info["config_changes"]] == [("model", str(model_dir), str(other))]


def test_runs_named_by_any_mode_train_with_the_residual_draw_and_a_draft_age(model_dir, data_file, tmp_path):
    out = tmp_path / "run"
    argv = _train_argv(model_dir, data_file, out, "--modes", "l=1-res,spec-age1", "--epochs", "3", "--lr", "5e-2")
    assert main(argv + ["--max-response-len", "6"]) == 0
    summary = json.loads((out / "summary.json").read_text())["runs"]
    residual, aged = summary["l=1-res"], summary["spec-age1"]
    assert residual[0]["rejection_draw"] == "residual" and residual[0]["lenience"] == 1.0
    assert residual[1]["drafts_found"] == 4 and residual[1]["drafts_dropped"] == 0  # the step's weights were kept
    assert aged[0]["max_draft_age"] == 1 and aged[0]["lenience"] == pytest.approx(2.718281828**0.5)
    # age 1: a slot that reused its draft in epoch 2 samples fresh in epoch 3
    reused = aged[1]["count_reused_whole"] + aged[1]["count_partly_reused"]
    assert reused > 0 and aged[2]["drafts_dropped"] == reused


def test_a_demo_cache_dir_that_is_a_file_is_refused(data_file, tmp_path, capsys):
    argv = ["train", "--cache-dir", str(data_file), "--epochs", "1", "--out", str(tmp_path / "run")]
    assert f"--cache-dir {data_file}: not a folder" in _error_line(capsys, argv)
    assert not (tmp_path / "run").exists()


def test_sweep_refuses_zero_counts_instead_of_taking_the_preset(tmp_path, capsys):
    for flag, expected in [("--epochs", "--epochs must be >= 1"), ("--eval-samples", "--eval-samples must be >= 1")]:
        argv = ["sweep", flag, "0", "--out", str(tmp_path / "s")]
        assert expected in _error_line(capsys, argv)
    assert not (tmp_path / "s").exists()


def test_unreadable_sources_are_named_by_their_flag(model_dir, data_file, tmp_path, capsys):
    argv = ["train", "--model", str(model_dir), "--hf-dataset", str(tmp_path / "none"), "--out", str(tmp_path / "r")]
    assert f"--hf-dataset {tmp_path / 'none'}: " in _error_line(capsys, argv)
    cache = data_file / "cache"  # below a file: the folder cannot be made
    line = _error_line(capsys, ["train", "--cache-dir", str(cache), "--epochs", "1", "--out", str(tmp_path / "d")])
    assert f"--cache-dir {cache}: Not a directory; pass a folder you can write" in line


def test_sweep_needs_a_heldout_set(model_dir, data_file, tmp_path, capsys):
    argv = ["sweep", "--model", str(model_dir), "--data", str(data_file), "--out", str(tmp_path / "s")]
    assert "spec-rl sweep compares held-out rewards: pass --eval-data FILE" in _error_line(capsys, argv)
    assert "drop --no-eval" in _error_line(capsys, [*argv, "--no-eval"])
    assert "--settings: l=x: mode must be one of" in _error_line(capsys, [*argv, "--settings", "l=x"])
    assert "--preset sizes the demo task" in _error_line(capsys, [*argv, "--preset", "small"])
    assert not (tmp_path / "s").exists()


def test_a_run_whose_weight_copies_do_not_fit_is_refused_before_the_run_folder_exists(model_dir, data_file, tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--model", str(model_dir), "--data", str(data_file), "--modes", "vanilla,l=1-res"]
    with pytest.raises(SystemExit, match="--versions-on-disk"):
        main(
            [
                *argv,
                "--epochs",
                "2",
                "--max-response-len",
                "8",
                "--version-budget",
                "1e-9",
                "--out",
                str(out),
                "--no-eval",
            ]
        )
    assert not out.exists()
