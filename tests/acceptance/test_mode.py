"""RolloutMode and the acceptance rules: the one definition of how a rollout reuses responses (named modes, parsing,
overrides, records, the verify options it implies), and a rule added from outside in one file plus one registration."""

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch
from tiny_models import tiny_model

from spec_rl.acceptance.dispatch import VerifyOptions, verify_logprobs
from spec_rl.acceptance.mode import MODES, TAIL_WIDTH, RolloutMode
from spec_rl.acceptance.rules import (
    LENIENCE,
    LENIENCE_DEFAULTS,
    REJECTION_DRAWS,
    RULES,
    Exact,
    Lenient,
    RandomReuse,
    Rule,
    register_rule,
)
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.drafts.cache import RolloutCache
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings


def test_the_named_modes():
    assert REJECTION_DRAWS == ("policy", "without-draft", "residual") and set(RULES) >= {"lenient", "exact", "random"}
    assert MODES["vanilla"] == RolloutMode(None, tail=0) and not MODES["vanilla"].reuses_drafts
    assert MODES["histspec"] == RolloutMode(None, tail=TAIL_WIDTH) and not MODES["histspec"].reuses_drafts
    assert MODES["spec"] == RolloutMode(Lenient(math.exp(0.5), "policy"), tail=8)
    assert MODES["exact"].rule == Exact() and MODES["random"].rule == RandomReuse()
    assert [m for m, mode in MODES.items() if mode.lossless] == ["vanilla", "histspec", "exact"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        MODES["spec"].rule.lenience = 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        MODES["spec"].tail = 2


@pytest.mark.parametrize(
    "text, mode",
    [
        ("exact", MODES["exact"]),
        ("l=1", RolloutMode(Lenient(1.0))),
        ("l=e^0.5", MODES["spec"]),
        ("l=inf", RolloutMode(Lenient(math.inf))),
        ("l=e^1000", RolloutMode(Lenient(math.inf))),  # past float range, as "l=1e400" reads
        ("l=0", RolloutMode(Lenient(0.0))),
        ("l=1-excl", RolloutMode(Lenient(1.0, "without-draft"))),
        ("l=1-res", RolloutMode(Lenient(1.0, "residual"))),
        ("l=e^-0.5", RolloutMode(Lenient(math.exp(-0.5)))),
        ("spec-age2", RolloutMode(Lenient(), max_draft_age=2)),
        ("l=e^0.5-excl-age1", RolloutMode(Lenient(rejection_draw="without-draft"), max_draft_age=1)),
        ("exact-age3", RolloutMode(Exact(), max_draft_age=3)),
        (MODES["random"], MODES["random"]),
        (Exact(), MODES["exact"]),
    ],
)
def test_modes_parse_from_names(text, mode):
    assert RolloutMode.parse(text) == mode


@pytest.mark.parametrize(
    "text",
    ["random-ref", "l=", "l=nan", "l=-1", "l=abc", "", None, 3, "l=0.5-excl", "l=2-res", "vanilla-age2", "spec-age0"]
    + ["l=1_0", "spec+tis"],
)
def test_names_that_name_no_mode_are_refused(text):
    with pytest.raises(ValueError) as info:
        RolloutMode.parse(text)
    message = str(info.value)
    if text == "l=0.5-excl":
        assert "needs lenience >= 1, got 0.5" in message
    elif text == "l=2-res":
        assert "rejection_draw 'residual' needs lenience 1, got 2" in message
    elif text == "spec-age0":
        assert message.startswith("max_draft_age must be >= 1, got 0")
    elif text == "spec+tis":
        assert message.endswith("a +tis / +mis suffix is a run's rollout correction: set rollout_correction instead")
    else:
        assert (
            "mode must be one of vanilla, histspec, spec, exact, coupled, random or l=<lenience>[-excl|-res]" in message
        )


def test_the_draft_age_bound_is_part_of_the_mode():
    mode = RolloutMode.parse("spec-age2")
    assert not mode.draft_expired(1) and mode.draft_expired(2) and not MODES["spec"].draft_expired(10**6)
    assert "max_draft_age" in mode.settable() and "max_draft_age" not in MODES["vanilla"].settable()
    assert MODES["spec"].with_overrides(max_draft_age=3).max_draft_age == 3
    assert RolloutMode.from_dict(mode.to_dict()) == mode and mode.to_dict()["max_draft_age"] == 2
    assert "drafts carried at most 2 epoch(s)" in mode.describe()
    legacy = {k: v for k, v in MODES["spec"].to_dict().items() if k != "max_draft_age"}  # a 0.4.0 record
    assert RolloutMode.from_dict(legacy) == MODES["spec"]
    with pytest.raises(TypeError, match="max_draft_age must be an integer"):
        RolloutMode(max_draft_age=1.5)


def test_the_papers_lenience_per_algorithm_is_the_lenient_default():
    assert LENIENCE_DEFAULTS == pytest.approx({"grpo": math.exp(0.5), "ppo": math.exp(0.3), "dapo": math.exp(0.15)})
    assert Lenient().lenience == LENIENCE == pytest.approx(math.exp(0.5))
    assert RolloutMode().rule == Lenient() and RolloutMode().log_lenience == pytest.approx(0.5)
    assert Lenient(np.float32(2.0)).lenience == 2.0 and type(Lenient(np.float32(2.0)).lenience) is float
    assert Lenient(math.inf).log_lenience == math.inf
    assert Lenient(0.0).log_lenience == -math.inf  # rejects every draft token
    for mode in (MODES["exact"], MODES["random"], MODES["vanilla"]):  # the other rules read no lenience
        assert mode.log_lenience == 0.0


@pytest.mark.parametrize(
    "build, error, words",
    [
        (lambda: Lenient(-1.0), ValueError, "lenience must be a number (inf allowed) >= 0, got -1.0"),
        (lambda: Lenient(math.nan), ValueError, "lenience must be a number (inf allowed) >= 0, got nan"),
        (lambda: Lenient("auto"), TypeError, "lenience must be a real number, got str 'auto'"),
        (lambda: Lenient(True), TypeError, "lenience must be a real number, got bool"),
        (lambda: Lenient(rejection_draw="resid"), ValueError, "rejection_draw must be one of ('policy', 'without"),
        (lambda: Lenient(rejection_draw="residual"), ValueError, "rejection_draw 'residual' needs lenience 1, got 1.6"),
        (lambda: Lenient(0.5, "without-draft"), ValueError, "needs lenience >= 1, got 0.5"),
        (lambda: Exact(2.0), TypeError, "positional argument"),
        (lambda: RolloutMode("exact"), TypeError, "rule must be an acceptance rule"),
        (lambda: RolloutMode(tail=True), TypeError, "tail must be an integer, got bool True"),
        (lambda: RolloutMode(tail=-1), ValueError, "tail must be >= 0, got -1"),
        (lambda: RolloutMode(tail=1.5), TypeError, "tail must be an integer, got float 1.5"),
    ],
)
def test_bad_modes_are_refused_naming_the_field(build, error, words):
    with pytest.raises(error) as info:
        build()
    assert words in str(info.value)


def test_overrides_set_only_the_fields_a_mode_has():
    assert MODES["spec"].settable() == ("lenience", "rejection_draw", "tail", "max_draft_age")
    assert MODES["exact"].settable() == MODES["random"].settable() == ("tail", "max_draft_age")
    assert MODES["vanilla"].settable() == () and MODES["histspec"].settable() == ("tail",)
    every = dict(lenience=1.0, rejection_draw="without-draft", tail=0)
    assert MODES["spec"].with_overrides(**every) == RolloutMode(Lenient(1.0, "without-draft"), tail=0)
    assert MODES["exact"].with_overrides(tail=0, max_draft_age=2) == RolloutMode(Exact(), tail=0, max_draft_age=2)
    assert MODES["histspec"].with_overrides(tail=4) == RolloutMode(None, tail=4)  # was ignored before 0.6
    for mode, field in ((MODES["exact"], "lenience"), (MODES["vanilla"], "tail"), (MODES["histspec"], "max_draft_age")):
        with pytest.raises(ValueError, match=f"^{field}: this mode .* has no such setting"):
            mode.with_overrides(**{field: 1})
    with pytest.raises(ValueError, match="needs lenience >= 1"):  # the result is checked like any mode
        MODES["spec"].with_overrides(lenience=0.5, rejection_draw="without-draft")


def test_to_dict_is_what_records_hold_and_reads_back():
    assert MODES["spec"].to_dict() == {
        "acceptance": "lenient",
        "lenience": pytest.approx(math.exp(0.5)),
        "rejection_draw": "policy",
        "tail": 8,
        "max_draft_age": None,
        "log_lenience": pytest.approx(0.5),
    }
    assert MODES["vanilla"].to_dict() == {"acceptance": None, "tail": 0, "max_draft_age": None, "log_lenience": 0.0}
    assert MODES["exact"].to_dict() == {"acceptance": "exact", "tail": 8, "max_draft_age": None, "log_lenience": 0.0}
    for mode in MODES.values():
        assert RolloutMode.from_dict(mode.to_dict()) == mode
    # a record of 0.3 (tail a bool; every field present) reads back as the same mode
    old = {"acceptance": "exact", "lenience": None, "rejection_draw": "policy", "tail": True, "log_lenience": 0.0}
    assert RolloutMode.from_dict(old) == MODES["exact"]
    assert MODES["spec"].describe() == "lenient acceptance at l = 1.649, rejection draw policy, tail speculation on"
    assert MODES["vanilla"].describe() == "no draft reuse, tail speculation off"


def test_verify_options_take_a_mode_its_name_or_a_rule():
    spec = VerifyOptions(Lenient(2.0), backend="reference")
    assert (spec.rule, spec.mode, spec.backend) == (Lenient(2.0), RolloutMode(Lenient(2.0)), "reference")
    assert VerifyOptions(MODES["exact"]) == VerifyOptions("exact") == VerifyOptions(Exact())
    assert VerifyOptions().mode == MODES["spec"]  # one default lenience everywhere: the paper's e^0.5
    for name in ("vanilla", "histspec"):
        with pytest.raises(ValueError, match="reuses no drafts"):
            VerifyOptions(name)
    with pytest.raises(ValueError, match="mode must be one of"):
        VerifyOptions("greedy")


@register_rule
@dataclass(frozen=True)
class FirstTokens(Rule):
    """A toy rule: keep the first ``k`` draft tokens whatever the scores (tests only)."""

    name: ClassVar[str] = "first-tokens"
    k: int = 2

    def decide(self, lp_new, lp_old, lengths, seed, uids):
        n = torch.clamp(lengths, max=self.k)
        return torch.arange(lp_new.shape[1]).unsqueeze(0) < n.unsqueeze(1), n


@register_rule
@dataclass(frozen=True)
class Likely(Rule):
    """A toy per-token rule: accept draft tokens while the current policy gives them at least ``p``."""

    name: ClassVar[str] = "likely"
    p: float = 0.05

    def test(self, lp_new, lp_old, u):
        return lp_new >= math.log(self.p)


def test_a_rule_added_in_one_file_and_one_registration_runs_everywhere():
    assert RULES["first-tokens"] is FirstTokens and RolloutMode.from_dict({"acceptance": "likely", "p": 0.2}).rule == (
        Likely(0.2)
    )
    ids, lengths = torch.tensor([[4, 5, 6], [7, 8, 0]]), torch.tensor([3, 1])
    new = torch.log(torch.tensor([[0.5, 0.01, 0.5], [0.3, 1.0, 1.0]]))
    res = verify_logprobs(ids, torch.zeros(2, 3), new, lengths, options=VerifyOptions(Likely(0.1)))
    assert res.accepted_len.tolist() == [1, 1]
    res = verify_logprobs(ids, torch.zeros(2, 3), new, lengths, options=VerifyOptions(FirstTokens(2)))
    assert res.accepted_len.tolist() == [2, 1]

    prompts = [[3, 11, 12, 13], [3, 15, 16]]
    requests = [RolloutRequest(p, s) for p in prompts for s in range(3)]
    for rule in (FirstTokens(2), Likely(0.03)):
        model = tiny_model(seed=3)
        rollout = SpeculativeRollout(
            TransformersBackend(model, {1}, pad_id=0),
            RolloutCache(),
            SamplingSettings(temperature=1.0, max_tokens=12),
            eos_ids=[1],
            max_model_len=64,
            mode=RolloutMode(rule, tail=0),
            seed=4,
        )
        first = rollout.run(requests, 0)
        second = rollout.run(requests, 1)
        assert second.stats.drafts_found == len(requests)
        for a, b, n in zip(first.response_ids, second.response_ids, second.verified_prefix_len):
            assert b[:n] == a[:n]
        if isinstance(rule, FirstTokens):
            assert second.verified_prefix_len == [min(2, len(r)) for r in first.response_ids]
        else:
            assert 0 < second.stats.accepted_tokens < second.stats.draft_tokens
        assert second.stats.tokens_generated == second.stats.vanilla_tokens - second.stats.accepted_tokens
