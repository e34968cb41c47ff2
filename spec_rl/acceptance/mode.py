"""The run mode: how a rollout reuses last epoch's responses. The one concept every entry point takes (verify, the
rollout, the trainer, the command line, the sweep, the adapters); docs/design.md "Run modes"."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..util.validation import check_int
from .rules import LENIENCE, Exact, Lenient, RandomReuse, Rule, rule_from_dict

#: Most history-drafted tokens verified per decode step under tail speculation (docs/design.md "Tail speculation").
TAIL_WIDTH = 8


@dataclass(frozen=True)
class RolloutMode:
    """``rule``: the acceptance rule of last epoch's drafts (:mod:`spec_rl.acceptance.rules`), None: every response is
    generated. ``tail``: most history-drafted tokens verified per decode step, 0: off (tail speculation changes decode
    steps, never a token). TypeError for a rule that is not a Rule or a tail that is not an int; ValueError for a
    negative tail."""

    rule: Rule | None = field(default_factory=Lenient)
    tail: int = TAIL_WIDTH

    def __post_init__(self) -> None:
        if self.rule is not None and not isinstance(self.rule, Rule):
            raise TypeError(
                f"rule must be an acceptance rule (spec_rl.acceptance.rules: Lenient(), Exact(), RandomReuse()) or "
                f"None, got {type(self.rule).__name__}; a mode by name: RolloutMode.parse({self.rule!r})"
            )
        check_int("tail", self.tail, low=0, hint=" (most history-drafted tokens per decode step; 0: off)")

    @property
    def reuses_drafts(self) -> bool:
        return self.rule is not None

    @property
    def lossless(self) -> bool:
        """Responses are fresh samples of the current policy (vanilla's, token for token, under the same keys)."""
        return self.rule is None or self.rule.lossless

    @property
    def log_lenience(self) -> float:
        return 0.0 if self.rule is None else self.rule.log_lenience

    def settable(self) -> tuple[str, ...]:
        """The fields a user may set on this mode: its rule's, and ``tail`` when it reuses drafts."""
        return () if self.rule is None else (*self.rule.settable(), "tail")

    def with_overrides(self, **overrides) -> RolloutMode:
        """This mode with each of ``overrides`` it has (:meth:`settable`) set; the others are ignored."""
        ours = {k: v for k, v in overrides.items() if k in self.settable()}
        tail = ours.pop("tail", self.tail)
        rule = dataclasses.replace(self.rule, **ours) if ours else self.rule
        return RolloutMode(rule, tail)

    def to_dict(self) -> dict:
        rule = self.rule.to_dict() if self.rule is not None else {"acceptance": None}
        return {**rule, "tail": self.tail, "log_lenience": self.log_lenience}

    @classmethod
    def from_dict(cls, data: dict) -> RolloutMode:
        tail = data.get("tail", TAIL_WIDTH)
        return cls(rule_from_dict(data), TAIL_WIDTH if tail is True else int(tail))

    def describe(self) -> str:
        """The mode in a report line: its rule and tail speculation."""
        rule = "no draft reuse" if self.rule is None else self.rule.describe()
        return f"{rule}, tail speculation {'on' if self.tail else 'off'}"

    @classmethod
    def parse(cls, text) -> RolloutMode:
        """A mode by name: one of :data:`MODES`, or ``l=<lenience>`` (lenient, e.g. ``l=1``, ``l=e^0.5``, ``l=inf``)
        with ``-excl`` for the without-draft draw; a RolloutMode is returned as it is. ValueError naming the choices."""
        if isinstance(text, RolloutMode):
            return text
        if isinstance(text, Rule):
            return cls(text)
        if isinstance(text, str) and text in MODES:
            return MODES[text]
        if isinstance(text, str) and text.startswith("l="):
            value, excl = (text[2:-5], True) if text.endswith("-excl") else (text[2:], False)
            lenience = parse_lenience(value)
            if lenience is not None:
                return cls(Lenient(lenience, "without-draft" if excl else "policy"))
        raise ValueError(
            f"mode must be one of {', '.join(MODES)} or l=<lenience>[-excl] (e.g. l=1, l=e^0.5-excl), got {text!r}"
        )


def parse_lenience(text: str) -> float | None:
    """A lenience written as a number or ``e^x`` (inf allowed); None when it is no number >= 0."""
    try:
        value = math.exp(float(text[2:])) if text.startswith("e^") else float(text)
    except ValueError:
        return None
    return value if value >= 0 else None


#: The named modes. "vanilla" is the reference of every ratio (no drafts, no tail speculation); "histspec" decodes
#: with tail speculation only (HistoSpec-style); "spec" is SPEC-RL at the paper's e^0.5.
MODES = {
    "vanilla": RolloutMode(None, tail=0),
    "histspec": RolloutMode(None),
    "spec": RolloutMode(Lenient(LENIENCE)),
    "exact": RolloutMode(Exact()),
    "random": RolloutMode(RandomReuse()),
}


def mode_names(names) -> list[str]:
    """``names`` (of :data:`MODES`) as a list of runs; ValueError for an unknown name, a name twice or none."""
    names = list(names)
    unknown = [m for m in names if m not in MODES]
    problem = (
        f"takes {', '.join(MODES)}; got {unknown}"
        if unknown
        else "is empty: name at least one run (e.g. vanilla,spec)"
        if not names
        else f"names a run twice: {names} (each run has one folder)"
        if len(set(names)) != len(names)
        else None
    )
    if problem:
        raise ValueError(f"modes {problem}")
    return names


#: The run every ratio is to.
VANILLA = "vanilla"
