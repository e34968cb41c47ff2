"""examples/trl_grpo.py runs end to end (tiny model, 2 epochs) and reuses drafts in epoch 2."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
from repo_paths import EXAMPLES

pytest.importorskip("trl", reason="trl is not installed (pip install 'spec-rl[trl]')")

SCRIPT = EXAMPLES / "trl_grpo.py"


def _load():
    spec = importlib.util.spec_from_file_location("trl_grpo_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, capsys, *extra):
    args = [
        "--model",
        "tiny",
        "--prompts",
        "4",
        "--epochs",
        "2",
        "--num-generations",
        "2",
        "--max-completion-length",
        "12",
        "--out",
        str(tmp_path / "out"),
        *extra,
    ]
    assert _load().main(args) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_example_reuses_drafts_in_the_second_epoch(tmp_path, capsys):
    result = _run(tmp_path, capsys)
    assert (result["acceptance"], result["rejection_draw"]) == ("lenient", "policy")
    assert result["lenience"] == pytest.approx(math.exp(0.5))  # the paper's GRPO l by default
    first, second = result["epochs"]
    assert first["reused_tokens"] == 0 and first["tokens_generated"] > 0
    assert second["reused_tokens"] > 0 and second["tokens_generated"] < first["tokens_generated"]
    assert (tmp_path / "out" / "spec_rl_cache.safetensors").exists()


def test_example_baseline_reuses_nothing(tmp_path, capsys):
    result = _run(tmp_path, capsys, "--mode", "vanilla")
    assert result["acceptance"] is None and result["tail"] == 0
    assert all(e["reused_tokens"] == 0 and e["tokens_generated"] > 0 for e in result["epochs"])


def test_example_refuses_a_missing_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="local checkpoint directory"):
        _load().main(["--model", str(tmp_path / "nope")])


def test_example_runs_the_lossless_rule_and_the_without_draft_draw(tmp_path, capsys):
    # The tiny model is near uniform over ~300 tokens and barely moves at lr 1e-5: exact acceptance keeps a draft
    # token with probability pi_t(y) (~1/300), the lenient rule at l = 1 with probability ~min(1, p / q) ~ 1.
    exact = _run(tmp_path / "exact", capsys, "--mode", "exact")
    draw = _run(tmp_path / "draw", capsys, "--mode", "l=1-excl")
    assert exact["acceptance"] == "exact" and "lenience" not in exact
    assert draw["rejection_draw"] == "without-draft" and draw["lenience"] == 1.0
    total = draw["epochs"][1]["reused_tokens"] + draw["epochs"][1]["tokens_generated"]
    assert draw["epochs"][1]["reused_tokens"] > 0.5 * total
    assert exact["epochs"][1]["reused_tokens"] < 0.1 * total and exact["epochs"][1]["tokens_generated"] > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mode", "l=0.5-excl"], "needs lenience >= 1"),
        (
            ["--mode", "exact-l=2"],
            "mode must be one of vanilla, histspec, spec, exact, coupled, random or l=<lenience>",
        ),
        (["--mode", "l=-1"], "mode must be one of"),
    ],
)
def test_example_refuses_rules_that_do_not_combine(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as err:
        _load().main(["--model", "tiny", "--out", str(tmp_path / "out"), *flags])
    assert err.value.code == 2 and message in capsys.readouterr().err
