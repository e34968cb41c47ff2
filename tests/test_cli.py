"""`spec-rl train` on a local checkpoint and real GSM8K-format data."""

import json
from pathlib import Path

import pytest
from tiny_models import tiny_model, tiny_tokenizer

from spec_rl.cli import main

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture()
def model_dir(tmp_path):
    path = tmp_path / "policy"
    tiny_model(seed=0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.skipif(not (SHARED / "gsm8k_test.jsonl").is_file(), reason="shared GSM8K file not present")
def test_train_on_local_model_and_gsm8k_file(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main([
        "train", "--model", str(model_dir), "--data", str(SHARED / "gsm8k_test.jsonl"), "--limit", "4",
        "--epochs", "2", "--group-size", "2", "--prompts-per-step", "4", "--max-response-len", "8",
        "--max-model-len", "128", "--out", str(out), "--no-progress", "--compare", "--no-checkpoint",
    ])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"vanilla", "spec"}
    assert summary["spec"][1]["drafts_found"] == 8
    printed = capsys.readouterr().out
    assert "reward" in printed and "spec/vanilla, epochs 2+: generated tokens" in printed and "decode steps" in printed


def test_bad_cli_input(tmp_path, model_dir, capsys):
    # Bad input: one "spec-rl: error: ..." line and exit status 2 (argparse's convention), no traceback.
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", str(tmp_path / "nope"), "--data", str(tmp_path / "x.jsonl"), "--no-progress",
              "--out", str(tmp_path / "r")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("spec-rl: error: --model") and "config.json" in err
    with pytest.raises(SystemExit, match="--data"):
        main(["train", "--model", str(model_dir), "--no-progress"])
    with pytest.raises(SystemExit):
        main(["train", "--lenience", "-1"])
    with pytest.raises(SystemExit, match="--modes"):
        main(["train", "--model", str(model_dir), "--data", "x", "--modes", "fast"])
