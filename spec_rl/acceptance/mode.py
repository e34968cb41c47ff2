"""The run mode: how a rollout reuses earlier responses. One definition; the trainer's presets, the rollout,
verify's dispatch, the adapters and the command line are derived from it (docs/design.md "Run modes")."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..util.validation import check_choice, check_real

#: "lenient": the paper's test (Alg. 1); "exact": lossless acceptance of a point-mass draft; "random": the
#: random-reuse ablation (paper Table 2: the rejection index is uniform over 0..R, the scores are ignored).
ACCEPTANCE_RULES = ("lenient", "exact", "random")
#: The token at a lenient rejection: "policy" draws it from pi_t (the paper); "without-draft" from pi_t without
#: the rejected draft token, renormalised (never returns the token just rejected).
REJECTION_DRAWS = ("policy", "without-draft")
#: The paper's lenience per RL algorithm (App. A.1).
LENIENCE_DEFAULTS = {"grpo": math.exp(0.5), "ppo": math.exp(0.3), "dapo": math.exp(0.15)}


@dataclass(frozen=True)
class RolloutMode:
    """How a rollout uses last epoch's responses.

    ``acceptance``: None (every response is generated) or one of :data:`ACCEPTANCE_RULES`. ``lenience``: l >= 0 of
    the lenient rule (inf reuses every draft); None becomes the paper's GRPO default e^0.5 under "lenient".
    ``rejection_draw``: one of :data:`REJECTION_DRAWS`. ``tail``: tail speculation (lossless: it changes decode
    steps, never a token). ValueError for an unknown rule or draw, l < 0 or NaN, or a lenience or draw given to a
    rule without them; TypeError for a non-bool ``tail``.
    """

    acceptance: str | None = "lenient"
    lenience: float | None = None
    rejection_draw: str = "policy"
    tail: bool = True

    def __post_init__(self) -> None:
        if self.acceptance is not None:
            check_choice("acceptance", self.acceptance, ACCEPTANCE_RULES, hint="or None: no drafts")
        check_choice("rejection_draw", self.rejection_draw, REJECTION_DRAWS)
        if not isinstance(self.tail, bool):
            raise TypeError(f"tail must be True or False, got {self.tail!r}")
        lenient = self.acceptance == "lenient"
        if lenient and self.lenience is None:
            object.__setattr__(self, "lenience", LENIENCE_DEFAULTS["grpo"])
        if self.lenience is not None:
            if not lenient:
                raise ValueError(f"lenience applies to lenient acceptance only, not {self.acceptance!r}; drop it")
            lenience = check_real(
                "lenience",
                self.lenience,
                low=0.0,
                finite=False,
                hint=" (1 is vanilla speculative decoding, inf reuses every draft, 0 none)",
            )
            object.__setattr__(self, "lenience", lenience)
        if self.rejection_draw != "policy" and not lenient:
            raise ValueError(f"rejection_draw applies to lenient acceptance only, not {self.acceptance!r}; drop it")
        if self.rejection_draw != "policy" and self.lenience is not None and self.lenience < 1:
            raise ValueError(
                f"rejection_draw {self.rejection_draw!r} needs lenience >= 1, got {self.lenience:g}: "
                "below 1 the residual keeps the rejected token"
            )

    @property
    def reuses_drafts(self) -> bool:
        return self.acceptance is not None

    @property
    def log_lenience(self) -> float:
        """log l of the lenient rule (0 for the other rules: they do not read it)."""
        if self.acceptance != "lenient":
            return 0.0
        return math.log(self.lenience) if self.lenience > 0 else float("-inf")

    def settable(self) -> tuple[str, ...]:
        """The fields a user may still change on this mode (what :meth:`with_overrides` applies)."""
        if self.acceptance == "lenient":
            return ("lenience", "rejection_draw", "tail")
        return ("tail",) if self.reuses_drafts else ()

    def with_overrides(self, **overrides) -> RolloutMode:
        """This mode with every settable field of ``overrides`` set (fields it does not have are left out)."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if k in self.settable()})

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "log_lenience": self.log_lenience}

    @classmethod
    def from_dict(cls, data: dict) -> RolloutMode:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


#: The named modes of the trainer, the command line and the adapters. "vanilla" is the reference of every
#: ratio; "histspec" is vanilla decoding with tail speculation only (HistoSpec-style); "spec" is SPEC-RL.
MODES = {
    "vanilla": RolloutMode(acceptance=None, tail=False),
    "histspec": RolloutMode(acceptance=None, tail=True),
    "spec": RolloutMode("lenient"),
    "exact": RolloutMode("exact"),
    "random": RolloutMode("random"),
}
#: Modes whose responses are vanilla's token for token (up to rounding of the logits).
LOSSLESS_MODES = ("exact", "histspec")


def named_mode(name: str) -> RolloutMode:
    """The mode called ``name`` in :data:`MODES`; ValueError naming the choices otherwise."""
    check_choice("mode", name, tuple(MODES))
    return MODES[name]


#: The adapters' ``strategy`` option (TRL, verl, OpenRLHF): reuse drafts under ``acceptance``, the random-reuse
#: ablation, or none (the baseline, with the same requests and bookkeeping).
STRATEGIES = ("spec", "random", "off")


def mode_from_options(
    strategy: str = "spec",
    acceptance: str = "lenient",
    lenience: float | None = None,
    rejection_draw: str = "policy",
    tail: bool = True,
) -> RolloutMode:
    """The :class:`RolloutMode` the adapters' options name. ValueError for an unknown strategy or rule, exact
    acceptance with a lenience (other than None or 1) or without reuse, or a rejection draw the rule cannot take."""
    if strategy is False:  # YAML 1.1 reads an unquoted `strategy: off` as false
        raise ValueError(f'strategy must be one of {STRATEGIES}, got False; in YAML write strategy: "off" (quoted)')
    check_choice("strategy", strategy, STRATEGIES)
    check_choice("acceptance", acceptance, ACCEPTANCE_RULES[:2])
    if acceptance == "exact" and strategy != "spec":
        raise ValueError(f"acceptance='exact' applies to strategy='spec' (lossless reuse), not {strategy!r}")
    if acceptance == "exact" and lenience not in (None, 1, 1.0):
        raise ValueError(
            f"acceptance='exact' has no lenience (it accepts a draft token with probability "
            f"pi_t(token)), but lenience={lenience!r} was passed; leave it unset or use 'lenient'"
        )
    if strategy == "off":  # a draw other than "policy" is refused: no lenient rejection to draw at
        return RolloutMode(acceptance=None, rejection_draw=rejection_draw, tail=tail)
    if strategy == "random" or acceptance == "exact":
        return RolloutMode(
            acceptance="random" if strategy == "random" else "exact", rejection_draw=rejection_draw, tail=tail
        )
    return RolloutMode("lenient", lenience=lenience, rejection_draw=rejection_draw, tail=tail)
