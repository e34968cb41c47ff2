"""The real-model rollout benchmark runs end to end at tiny size (toy model, one prompt, two epochs); no timing
is asserted."""

import json
import sys

import pytest
from repo_paths import BENCHMARKS
from tiny_models import tiny_model, tiny_tokenizer

sys.path.insert(0, str(BENCHMARKS))

import bench_real_model  # noqa: E402


def test_two_epochs_of_every_mode_with_an_update_between(tmp_path, capsys):
    tiny_model(seed=0).save_pretrained(tmp_path / "ckpt")
    tiny_tokenizer().save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "bench.json"
    args = ["--model", str(tmp_path / "ckpt"), "--prompts", "1", "--group", "2", "--max-tokens", "6", "--epochs", "2"]
    assert bench_real_model.main(args + ["--engines", "transformers", "--lr", "1e-2", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["rows"]) == {f"transformers/{m}" for m in bench_real_model.BENCH_MODES}
    rows = record["rows"]
    for recs in rows.values():
        assert [r["epoch"] for r in recs] == [1, 2]
        assert (
            recs[0]["draft_tokens"] == 0
            and recs[0]["generated_tokens"] == rows["transformers/vanilla"][0]["generated_tokens"]
        )
        assert all(r["nll"] > 0 for r in recs)
    assert rows["transformers/spec"][1]["draft_tokens"] > 0  # epoch 2 verifies epoch 1's responses
    assert rows["transformers/vanilla"][1]["draft_tokens"] == 0
    summary = {s["row"]: s for s in record["summary"]}
    assert summary["vanilla"]["rollout_seconds_ratio"] == 1.0
    lo, mid, hi = summary["vanilla"]["nll"][1], summary["vanilla"]["nll"][0], summary["vanilla"]["nll"][2]
    assert lo <= mid <= hi
    assert "transformers: exact / vanilla rollout time" in record["targets"]
    assert "targets" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--epochs", "0"], "--epochs must be >= 1"),
        (["--modes", "spec,l=1"], "--modes must include vanilla"),
        (["--modes", "vanilla,fast"], "--modes: mode must be one of"),
        (["--engines", "vllm"], "--engines must include transformers"),
    ],
)
def test_bad_arguments_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_real_model.main(["--model", "unused"] + flags)
    assert message in capsys.readouterr().err


def test_a_model_path_without_a_checkpoint_is_a_clear_exit(tmp_path):
    with pytest.raises(SystemExit, match="--model: .*no config.json"):
        bench_real_model.main(["--model", str(tmp_path), "--engines", "transformers"])
