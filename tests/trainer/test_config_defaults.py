"""Lenience defaults per algorithm (paper App. A.1), adaptive lenience and random-ref in the trainer config and CLI."""

import math

import pytest

from spec_rl.cli import _config, _modes, build_parser
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
    assert _modes(args, demo=True) == ["random-ref"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--lenience", "often"])
    with pytest.raises(ConfigError, match="target_drift"):
        GRPOConfig(lenience="auto", target_drift=0.0)
