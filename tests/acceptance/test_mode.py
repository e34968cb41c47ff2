"""RolloutMode: the one definition of how a rollout reuses responses (named modes, the adapters' options, overrides,
records) and the verify options it implies."""

import dataclasses
import math

import numpy as np
import pytest

from spec_rl.acceptance.dispatch import VerifyOptions
from spec_rl.acceptance.mode import (
    ACCEPTANCE_RULES,
    LENIENCE_DEFAULTS,
    LOSSLESS_MODES,
    MODES,
    REJECTION_DRAWS,
    STRATEGIES,
    RolloutMode,
    mode_from_options,
    named_mode,
)


def test_the_named_modes():
    assert ACCEPTANCE_RULES == ("lenient", "exact", "random") and REJECTION_DRAWS == ("policy", "without-draft")
    assert MODES["vanilla"] == RolloutMode(None, tail=False) and not MODES["vanilla"].reuses_drafts
    assert MODES["histspec"] == RolloutMode(None, tail=True) and not MODES["histspec"].reuses_drafts
    assert MODES["spec"] == RolloutMode("lenient", lenience=math.exp(0.5), rejection_draw="policy", tail=True)
    assert MODES["exact"].acceptance == "exact" and MODES["exact"].tail and MODES["exact"].lenience is None
    assert MODES["random"].acceptance == "random" and MODES["random"].lenience is None
    assert set(LOSSLESS_MODES) <= set(MODES)
    assert named_mode("exact") is MODES["exact"]
    with pytest.raises(ValueError, match=r"mode must be one of \('vanilla', 'histspec', 'spec', 'exact', 'random'\)"):
        named_mode("random-ref")
    with pytest.raises(dataclasses.FrozenInstanceError):
        MODES["spec"].lenience = 2.0


def test_the_papers_lenience_per_algorithm_is_the_lenient_default():
    assert LENIENCE_DEFAULTS == pytest.approx({"grpo": math.exp(0.5), "ppo": math.exp(0.3), "dapo": math.exp(0.15)})
    assert RolloutMode("lenient").lenience == pytest.approx(math.exp(0.5))
    assert RolloutMode("lenient").log_lenience == pytest.approx(0.5)
    assert RolloutMode("lenient", lenience=np.float32(2.0)).lenience == 2.0
    assert type(RolloutMode("lenient", lenience=np.float32(2.0)).lenience) is float
    assert RolloutMode("lenient", lenience=math.inf).log_lenience == math.inf
    assert RolloutMode("lenient", lenience=0.0).lenience == 0.0  # rejects every draft token
    for rule in ("exact", "random", None):  # the other rules read no lenience
        assert RolloutMode(rule).log_lenience == 0.0


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(acceptance="fast"), ValueError, "acceptance must be one of ('lenient', 'exact', 'random') (or None: no "),
        (dict(acceptance="random-ref"), ValueError, "acceptance must be one of"),
        (dict(lenience=-1.0), ValueError, "lenience must be a number (inf allowed) >= 0, got -1.0"),
        (dict(lenience=math.nan), ValueError, "lenience must be a number (inf allowed) >= 0, got nan"),
        (dict(lenience="auto"), TypeError, "lenience must be a real number, got str 'auto'"),
        (dict(lenience=True), TypeError, "lenience must be a real number, got bool"),
        (
            dict(acceptance="exact", lenience=2.0),
            ValueError,
            "lenience applies to lenient acceptance only, not 'exact'",
        ),
        (
            dict(acceptance="random", lenience=1.0),
            ValueError,
            "lenience applies to lenient acceptance only, not 'random'",
        ),
        (dict(acceptance=None, lenience=1.0), ValueError, "lenience applies to lenient acceptance only, not None"),
        (dict(rejection_draw="residual"), ValueError, "rejection_draw must be one of ('policy', 'without-draft')"),
        (dict(acceptance="exact", rejection_draw="without-draft"), ValueError, "rejection_draw applies to lenient"),
        (dict(lenience=0.5, rejection_draw="without-draft"), ValueError, "needs lenience >= 1, got 0.5"),
        (dict(tail=1), TypeError, "tail must be True or False, got 1"),
    ],
)
def test_bad_modes_are_refused_naming_the_field(kwargs, error, words):
    with pytest.raises(error) as info:
        RolloutMode(**kwargs)
    assert words in str(info.value)


def test_overrides_set_only_the_fields_a_mode_has():
    assert MODES["spec"].settable() == ("lenience", "rejection_draw", "tail")
    assert MODES["exact"].settable() == MODES["random"].settable() == ("tail",)
    assert MODES["vanilla"].settable() == MODES["histspec"].settable() == ()
    every = dict(lenience=1.0, rejection_draw="without-draft", tail=False)
    assert MODES["spec"].with_overrides(**every) == RolloutMode("lenient", 1.0, "without-draft", tail=False)
    assert MODES["exact"].with_overrides(**every) == RolloutMode("exact", tail=False)
    assert MODES["vanilla"].with_overrides(**every) == MODES["vanilla"]
    assert MODES["histspec"].with_overrides(tail=False) == MODES["histspec"]  # histspec is tail speculation itself
    with pytest.raises(ValueError, match="needs lenience >= 1"):  # the result is checked like any mode
        MODES["spec"].with_overrides(lenience=0.5, rejection_draw="without-draft")


def test_to_dict_is_what_records_hold_and_reads_back():
    d = MODES["spec"].to_dict()
    assert d == {
        "acceptance": "lenient",
        "lenience": pytest.approx(math.exp(0.5)),
        "rejection_draw": "policy",
        "tail": True,
        "log_lenience": pytest.approx(0.5),
    }
    assert MODES["vanilla"].to_dict() == {
        "acceptance": None,
        "lenience": None,
        "rejection_draw": "policy",
        "tail": False,
        "log_lenience": 0.0,
    }
    for mode in MODES.values():
        assert RolloutMode.from_dict(mode.to_dict()) == mode


def test_verify_options_for_a_mode():
    spec = VerifyOptions.for_mode(RolloutMode("lenient", lenience=2.0), backend="reference")
    assert (spec.rule, spec.lenience, spec.backend) == ("lenient", 2.0, "reference")
    assert VerifyOptions.for_mode(MODES["exact"]) == VerifyOptions(rule="exact")
    assert VerifyOptions.for_mode(MODES["random"]) == VerifyOptions(rule="random")
    for name in ("vanilla", "histspec"):
        with pytest.raises(ValueError, match="reuses no drafts"):
            VerifyOptions.for_mode(MODES[name])


def test_the_adapters_options_name_a_mode():
    assert STRATEGIES == ("spec", "random", "off")
    assert mode_from_options() == MODES["spec"]
    assert mode_from_options(lenience=2.0, rejection_draw="without-draft", tail=False) == RolloutMode(
        "lenient", 2.0, "without-draft", tail=False
    )
    assert mode_from_options("random") == MODES["random"]
    assert mode_from_options("off", tail=False) == MODES["vanilla"] and mode_from_options("off") == MODES["histspec"]
    assert mode_from_options("random", lenience=2.0).lenience is None  # the ablation reads no lenience
    assert mode_from_options(acceptance="exact") == MODES["exact"]
    for unset in (None, 1, 1.0):  # 1 is "not set" for exact, as l = 1 is the exact test
        assert mode_from_options(acceptance="exact", lenience=unset) == MODES["exact"]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(strategy="random-ref"), "strategy must be one of ('spec', 'random', 'off'), got 'random-ref'"),
        (dict(strategy=False), 'in YAML write strategy: "off" (quoted)'),
        (dict(acceptance="random"), "acceptance must be one of ('lenient', 'exact'), got 'random'"),
        (dict(acceptance="exact", lenience=2.0), "acceptance='exact' has no lenience"),
        (dict(acceptance="exact", lenience=math.exp(0.5)), "but lenience=1.64"),
        (dict(strategy="random", acceptance="exact"), "acceptance='exact' applies to strategy='spec'"),
        (dict(strategy="off", acceptance="exact"), "acceptance='exact' applies to strategy='spec'"),
        (dict(strategy="off", rejection_draw="without-draft"), "rejection_draw applies to lenient acceptance only"),
        (dict(strategy="random", rejection_draw="without-draft"), "rejection_draw applies to lenient acceptance only"),
        (dict(acceptance="exact", rejection_draw="without-draft"), "rejection_draw applies to lenient acceptance only"),
        (dict(lenience=0.5, rejection_draw="without-draft"), "needs lenience >= 1"),
        (dict(lenience=-1.0), "lenience must be a number (inf allowed) >= 0"),
    ],
)
def test_options_that_name_no_mode_are_refused(kwargs, words):
    with pytest.raises(ValueError) as info:
        mode_from_options(**kwargs)
    assert words in str(info.value)


def test_a_lenience_of_zero_has_log_minus_infinity():
    mode = RolloutMode("lenient", 0.0)
    assert mode.log_lenience == float("-inf") and mode.to_dict()["log_lenience"] == float("-inf")
