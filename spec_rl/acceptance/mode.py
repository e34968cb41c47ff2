"""The run mode: how a rollout reuses last epoch's responses. The one concept every entry point takes (verify, the
rollout, the trainer, the command line, the sweep, the adapters); docs/design.md "Run modes"."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from ..util.validation import check_int, check_type
from .rules import LENIENCE, Coupled, Exact, Lenient, RandomReuse, Rule, rule_from_dict

#: Most history-drafted tokens verified per decode step under tail speculation (docs/design.md "Tail speculation").
TAIL_WIDTH = 8


@dataclass(frozen=True)
class RolloutMode:
    """``rule``: the acceptance rule of last epoch's drafts (:mod:`spec_rl.acceptance.rules`), None: every response is
    generated. ``tail``: most history-drafted tokens verified per decode step, 0: off (tail speculation changes decode
    steps, never a token). ``max_draft_age``: a slot whose response came from its draft (a verified prefix of at least
    one token) this many epochs in a row samples fresh the next epoch (None: no bound; docs/design.md "Draft age").
    TypeError for a rule that is not a Rule or a tail or age that is not an int; ValueError for a negative tail or an
    age < 1."""

    rule: Rule | None = field(default_factory=Lenient)
    tail: int = TAIL_WIDTH
    max_draft_age: int | None = None

    def __post_init__(self) -> None:
        rules = "an acceptance rule (spec_rl.acceptance.rules: Lenient(), Exact(), RandomReuse()) or None"
        check_type("rule", self.rule, (Rule, type(None)), rules, f"; a mode by name: RolloutMode.parse({self.rule!r})")
        check_int("tail", self.tail, low=0, hint=" (most history-drafted tokens per decode step; 0: off)")
        if self.max_draft_age is not None:
            check_int("max_draft_age", self.max_draft_age, low=1, hint=" (epochs a draft is carried; None: no bound)")

    @property
    def reuses_drafts(self) -> bool:
        return self.rule is not None

    @property
    def lossless(self) -> bool:
        """Responses are fresh samples of the current policy (vanilla's, token for token, under the same keys)."""
        return self.rule is None or self.rule.lossless

    def draft_expired(self, age: int) -> bool:
        """Whether a draft carried ``age`` epochs in a row is past :attr:`max_draft_age` (its slot samples fresh)."""
        return self.max_draft_age is not None and age >= self.max_draft_age

    @property
    def log_lenience(self) -> float:
        return 0.0 if self.rule is None else self.rule.log_lenience

    def settable(self) -> tuple[str, ...]:
        """The fields a user may set on this mode: its rule's, ``max_draft_age`` when it reuses drafts, and ``tail``
        when it reuses drafts or speculates from the history."""
        if self.rule is None:
            return ("tail",) if self.tail else ()
        return (*self.rule.settable(), "tail", "max_draft_age")

    def with_overrides(self, **overrides) -> RolloutMode:
        """This mode with ``overrides`` set; ValueError naming a field it does not have (:meth:`settable`)."""
        foreign = sorted(set(overrides) - set(self.settable()))
        if foreign:
            have = ", ".join(self.settable()) or "none"
            raise ValueError(
                f"{', '.join(foreign)}: this mode ({self.describe()}) has no such setting (its settings: {have})"
            )
        ours = dict(overrides)
        tail, age = ours.pop("tail", self.tail), ours.pop("max_draft_age", self.max_draft_age)
        rule = dataclasses.replace(self.rule, **ours) if ours else self.rule
        return RolloutMode(rule, tail, age)

    def to_dict(self) -> dict:
        rule = self.rule.to_dict() if self.rule is not None else {"acceptance": None}
        return {**rule, "tail": self.tail, "max_draft_age": self.max_draft_age, "log_lenience": self.log_lenience}

    @classmethod
    def from_dict(cls, data: dict) -> RolloutMode:
        tail = data.get("tail", TAIL_WIDTH)
        return cls(rule_from_dict(data), TAIL_WIDTH if tail is True else int(tail), data.get("max_draft_age"))

    def describe(self) -> str:
        """The mode in a report line: its rule, tail speculation and draft age bound."""
        rule = "no draft reuse" if self.rule is None else self.rule.describe()
        age = f", drafts carried at most {self.max_draft_age} epoch(s)" if self.max_draft_age else ""
        return f"{rule}, tail speculation {'on' if self.tail else 'off'}{age}"

    @classmethod
    def parse(cls, text) -> RolloutMode:
        """A mode by name: one of :data:`MODES`, or ``l=<lenience>`` (lenient, e.g. ``l=1``, ``l=e^0.5``, ``l=inf``)
        with ``-excl`` for the without-draft draw or ``-res`` for the residual draw, then optionally ``-age<N>`` for
        ``max_draft_age`` N (e.g. ``l=1-res``, ``spec-age2``); a RolloutMode is returned as it is. ValueError naming
        the choices."""
        if isinstance(text, RolloutMode):
            return text
        if isinstance(text, Rule):
            return cls(text)
        name = _AGED.fullmatch(text) if isinstance(text, str) else None
        mode = None
        if name is not None and name[1] in MODES:
            mode = MODES[name[1]]
        elif name is not None and name[1].startswith("l="):
            value, draw = re.fullmatch(r"(.*?)(?:-(excl|res))?", name[1][2:]).groups()
            lenience = parse_lenience(value)
            draws = {None: "policy", "excl": "without-draft", "res": "residual"}
            if lenience is not None:
                mode = cls(Lenient(lenience, draws[draw]))
        if mode is not None and name[2] is None:
            return mode
        if mode is not None and mode.reuses_drafts:
            return dataclasses.replace(mode, max_draft_age=int(name[2]))
        plus = isinstance(text, str) and "+" in text
        hint = "; a +tis / +mis suffix is a run's rollout correction: set rollout_correction instead" if plus else ""
        raise ValueError(
            f"mode must be one of {', '.join(MODES)} or l=<lenience>[-excl|-res], each reusing drafts with an optional "
            f"-age<N> (e.g. l=1-res, l=e^0.5-excl, spec-age2), got {text!r}" + hint
        )


#: A mode name and its optional ``-age<N>`` suffix.
_AGED = re.compile(r"(.+?)(?:-age(\d+))?")


def parse_lenience(text: str) -> float | None:
    """A lenience written as a number or ``e^x`` (inf allowed); None when it is no number >= 0."""
    if "_" in text:  # float() reads "1_0" as 10
        return None
    try:
        value = math.exp(float(text[2:])) if text.startswith("e^") else float(text)
    except ValueError:
        return None
    except OverflowError:  # e^1000: as "1e400" reads, an infinite lenience
        value = math.inf
    return value if value >= 0 else None


#: The named modes. "vanilla" is the reference of every ratio (no drafts, no tail speculation); "histspec" decodes
#: with tail speculation only (HistoSpec-style); "spec" is SPEC-RL at the paper's e^0.5; "coupled" is the exact walk
#: under keys shared by every step (a sample of the current policy that keeps what its choices did not change).
MODES = {
    "vanilla": RolloutMode(None, tail=0),
    "histspec": RolloutMode(None),
    "spec": RolloutMode(Lenient(LENIENCE)),
    "exact": RolloutMode(Exact()),
    "coupled": RolloutMode(Coupled()),
    "random": RolloutMode(RandomReuse()),
}


#: The run every ratio is to.
VANILLA = "vanilla"
#: The defaults are chosen by measurement (benchmarks/RESULTS.md "Reuse and learning"): of the settings a path can run
#: whose held-out gap to vanilla has a 95% interval containing 0, the one that saved the most generated tokens. The
#: trainer's: the coupled keys (exact samples of the current policy, no weight copies).
TRAINER_MODE = "coupled"
#: The adapters' (a serving engine draws its own keys and keeps no old weights, so neither coupled nor the residual
#: draw runs there): the paper's rule. The only adapter rule without a gap, exact, keeps 0.2-1.5% of a real model's
#: draft tokens at T = 1; the rollout correction its behaviour log-probs feed halves spec's learning cost (RESULTS).
ADAPTER_MODE = "spec"
