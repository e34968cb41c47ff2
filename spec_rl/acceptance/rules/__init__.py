"""The acceptance rules, one file each (docs/design.md "Acceptance rules"). A new rule is a file holding a
:class:`Rule` subclass and one ``register_rule`` line here."""

from .base import RULES, Rule, register_rule, rule_from_dict
from .coupled import Coupled
from .exact import Exact
from .lenient import LENIENCE, LENIENCE_DEFAULTS, REJECTION_DRAWS, Lenient
from .random_reuse import RandomReuse

register_rule(Lenient)
register_rule(Exact)
register_rule(RandomReuse)
register_rule(Coupled)

__all__ = [
    "LENIENCE",
    "LENIENCE_DEFAULTS",
    "REJECTION_DRAWS",
    "RULES",
    "Coupled",
    "Exact",
    "Lenient",
    "RandomReuse",
    "Rule",
    "register_rule",
    "rule_from_dict",
]
