"""Modes by rule name, for tests parametrized over the registered rules (not a test module)."""

from spec_rl.acceptance.mode import RolloutMode
from spec_rl.acceptance.rules import RULES


def rule_mode(name: str, lenience: float = 1.0, **fields) -> RolloutMode:
    """The mode of rule ``name`` (a key of RULES); ``lenience`` (and ``fields``) where the rule has such a field."""
    cls = RULES[name]
    given = {"lenience": lenience, **fields}
    return RolloutMode(cls(**{k: v for k, v in given.items() if k in cls.__dataclass_fields__}))
