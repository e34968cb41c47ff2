"""Procedurally generated multi-step arithmetic word problems in GSM8K format: the demo task.

A problem follows one person's stock of an item through a few events, each opened by a fixed connective that the
worked solution restates before its equation; the solution ends with ``#### <n>``. Counts stay in 1..``max_value``,
divisions are exact, and generation uses only ``random.Random(seed)``. Slips and the misconception feed the demo's
warm start (docs/design.md "The demo recipe")."""

from __future__ import annotations

import random
import re

from ..util.validation import check_int, check_real
from .data import Example, format_prompt

#: Bumped whenever the generator's output changes (part of the demo cache key).
TASK_VERSION = 1

_NAMES = [
    ("Tom", "he", "his"),
    ("Anna", "she", "her"),
    ("Ben", "he", "his"),
    ("Mia", "she", "her"),
    ("Sam", "he", "his"),
    ("Lily", "she", "her"),
    ("Max", "he", "his"),
    ("Emma", "she", "her"),
    ("Leo", "he", "his"),
    ("Zoe", "she", "her"),
    ("Jack", "he", "his"),
    ("Ella", "she", "her"),
]
_FRIENDS = ["Nina", "Omar", "Paul", "Rosa", "Ivan", "Kate", "Luis", "Hana"]
# (plural noun, container used for "k <container>s with m items each")
_OBJECTS = [
    ("apples", "bag"),
    ("pencils", "box"),
    ("stickers", "pack"),
    ("marbles", "jar"),
    ("cookies", "box"),
    ("cards", "pack"),
    ("shells", "bucket"),
    ("books", "box"),
    ("eggs", "carton"),
    ("flowers", "vase"),
    ("coins", "purse"),
    ("toys", "box"),
]
_CONTAINER_PLURAL = {"box": "boxes"}

# Connectives opening the event sentences, by number of events. The solution repeats them, so the model finds its
# event by matching the connective (an induction pattern) instead of counting sentences.
_CONNECTIVES = {
    1: ["Then"],
    2: ["First,", "Finally,"],
    3: ["First,", "Then", "Finally,"],
    4: ["First,", "Then", "Next,", "Finally,"],
    5: ["First,", "Then", "Next,", "After that,", "Finally,"],
    6: ["First,", "Then", "Next,", "After that,", "Later,", "Finally,"],
}
MAX_STEPS = max(_CONNECTIVES)

_SLIPS = (-2, -1, 1, 2)

# Wordings of "count goes up/down by b"; {friend} is drawn for every event, used or not.
_ADD_EVENTS = ("{he} buys {b} more {obj}", "{he} finds {b} more {obj}", "{he} gets {b} {obj} from {friend}")
_SUB_EVENTS = ("{he} gives {b} {obj} to {friend}", "{he} loses {b} {obj}", "{he} sells {b} {obj}")


def _count_event(rng: random.Random, wordings: tuple[str, ...], he: str, b: int, obj: str) -> str:
    """One wording of an add/sub event; draws the friend, then the wording (the generator's fixed order)."""
    friend = rng.choice(_FRIENDS)
    return rng.choice(wordings).format(he=he, b=b, obj=obj, friend=friend)


def _share_divisors(x: int, w: int) -> list[int]:
    """Group counts k that split both the true count ``x`` and the believed count ``w`` exactly."""
    return [k for k in (2, 3, 4, 5) if x % k == 0 and w % k == 0]


def _feasible_ops(x: int, w: int, max_value: int) -> list[str]:
    """The events possible from true count ``x`` and believed count ``w`` (valid for both)."""
    lo, hi = min(x, w), max(x, w)
    possible = {
        "add": hi + 1 <= max_value,
        "group": hi + 4 <= max_value,
        "sub": lo >= 2,
        "scale": 2 * hi <= max_value,
        "share": bool(_share_divisors(x, w)),
    }
    return [op for op, ok in possible.items() if ok]


def _one_problem(
    rng: random.Random, steps: int, max_value: int, max_operand: int, slip_prob: float, misconception_prob: float
):
    """(question, solution, answer), or None at a dead end. ``x`` is the true count, ``w`` the one the worked solution
    believes (after a slip or the misconception); every event is valid for both."""

    def slip(v: int) -> int:
        if slip_prob and rng.random() < slip_prob:
            return rng.choice([v + d for d in _SLIPS if 1 <= v + d <= max_value])
        return v

    name, he, his = rng.choice(_NAMES)
    obj, container = rng.choice(_OBJECTS)
    x = rng.randrange(2, min(max_operand, max_value) + 1)
    w = x
    opening = f"{name} has {x} {obj}."
    q_parts, s_lines = [opening], [opening]
    for conn in _CONNECTIVES[steps]:
        lo, hi = min(x, w), max(x, w)
        options = _feasible_ops(x, w, max_value)
        if not options:
            return None
        op = rng.choice(options)
        if op == "add":
            b = rng.randrange(1, min(max_operand, max_value - hi) + 1)
            x, wy = x + b, slip(w + b)
            event = _count_event(rng, _ADD_EVENTS, he, b, obj)
            calc = f"{w} + {b} = {wy}"
        elif op == "sub":
            b = rng.randrange(1, min(max_operand, lo - 1) + 1)
            x, wy = x - b, slip(w - b)
            event = _count_event(rng, _SUB_EVENTS, he, b, obj)
            calc = f"{w} - {b} = {wy}"
        elif op == "group":
            pairs = [(k, m) for k in range(2, 6) for m in range(2, 10) if hi + k * m <= max_value]
            k, m = rng.choice(pairs)
            if misconception_prob and rng.random() < misconception_prob:
                sign, p = "+", k + m  # the teacher's systematic error: adds the two numbers
            else:
                sign, p = "*", slip(k * m)
            x, wy = x + k * m, slip(w + p)
            containers = _CONTAINER_PLURAL.get(container, container + "s")
            event = f"{he} buys {k} {containers} with {m} {obj} in each {container}"
            calc = f"{k} {sign} {m} = {p} more, and {w} + {p} = {wy}"
        elif op == "scale":
            f = rng.choice([f for f in (2, 3) if f * hi <= max_value])
            x, wy = x * f, slip(w * f)
            event = f"{he} {'doubles' if f == 2 else 'triples'} {his} {obj}"
            calc = f"{w} * {f} = {wy}"
        else:  # share
            k = rng.choice(_share_divisors(x, w))
            x, wy = x // k, slip(w // k)
            event = f"{he} splits {his} {obj} into {k} equal groups and keeps one group"
            calc = f"{w} / {k} = {wy}"
        w = wy
        sentence = f"{conn} {event}"
        q_parts.append(sentence + ".")
        s_lines.append(f"{sentence}, so {he} has {calc} {obj}.")
    q_parts.append(f"How many {obj} does {name} have now?")
    s_lines.append(f"#### {w}")
    return " ".join(q_parts), "\n".join(s_lines), str(x)


def generate_problems(
    n: int,
    seed: int = 0,
    *,
    min_steps: int = 2,
    max_steps: int = 4,
    max_value: int = 99,
    max_operand: int = 20,
    unique: bool = True,
    exclude: set[str] | frozenset[str] | None = None,
    slip_prob: float = 0.0,
    misconception_prob: float = 0.0,
) -> list[Example]:
    """``n`` arithmetic word problems with worked GSM8K-style solutions; the same arguments give the same problems.
    ``min_steps``..``max_steps`` events per problem (1 <= min <= max <= :data:`MAX_STEPS`); every count stays in
    1..``max_value`` (>= 10); ``max_operand`` (>= 2) is the largest number added, subtracted or started from.
    ``unique`` skips repeated questions, ``exclude`` the questions of another split. ``slip_prob`` in [0, 1): chance
    that each written result is off by 1 or 2 (later lines continue from it, so the solution ends wrong while
    ``answer`` stays true); ``misconception_prob`` in [0, 1): chance that "k boxes with m in each" is worked as k + m
    (a systematic error). Returns :class:`~spec_rl.tasks.data.Example` with ``source="arith"`` and
    ``uid = f"arith:{seed}:{i}"``. TypeError or ValueError for a bad argument (named); ValueError when the options
    cannot produce ``n`` distinct problems."""
    check_int("n", n, low=0)
    check_int("seed", seed)
    check_int("min_steps", min_steps, low=1)
    check_int("max_steps", max_steps, low=min_steps, high=MAX_STEPS, hint=" (needs min_steps <= max_steps)")
    check_int("max_value", max_value, low=10)
    check_int("max_operand", max_operand, low=2)
    check_real("slip_prob", slip_prob, low=0, high=1, high_open=True)
    check_real("misconception_prob", misconception_prob, low=0, high=1, high_open=True)
    rng = random.Random(seed)
    seen: set[str] = set(exclude or ())
    out: list[Example] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(
                f"could only generate {len(out)} distinct problems out of n={n}; "
                f"lower n or widen max_steps/max_value/max_operand"
            )
        steps = rng.randrange(min_steps, max_steps + 1)
        drawn = _one_problem(rng, steps, max_value, max_operand, slip_prob, misconception_prob)
        if drawn is None:
            continue
        question, solution, answer = drawn
        if (unique or exclude) and question in seen:
            continue
        seen.add(question)
        uid = f"arith:{seed}:{len(out)}"
        out.append(Example(format_prompt(question), answer, uid, "arith", solution, question))
    return out


_EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def check_solution(solution: str) -> bool:
    """True if a worked solution in this task's format is consistent. Every equation ``a op b = c`` holds (division
    exact), each line's last equation starts from the previous result (in a "group" line the second adds the first one's
    result), and the last line is ``#### <final result>``."""
    lines = solution.strip().split("\n")
    if len(lines) < 2 or not lines[-1].startswith("#### "):
        return False
    start = re.findall(r"\d+", lines[0])
    if len(start) != 1:
        return False
    current = int(start[0])
    for line in lines[1:-1]:
        eqs = [(int(a), op, int(b), int(c)) for a, op, b, c in _EQUATION.findall(line)]
        if not eqs or len(eqs) > 2:
            return False
        for a, op, b, c in eqs:
            exact = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b and a % b == 0 else None}[op]
            if exact != c:
                return False
        if eqs[-1][0] != current or (len(eqs) == 2 and eqs[-1][2] != eqs[0][3]):
            return False
        current = eqs[-1][3]
    return lines[-1] == f"#### {current}"


def arithmetic_reward(completion: str, gold: str) -> float:
    """The demo task's reward: 1.0 when the worked solution is consistent (:func:`check_solution`) and its last line is
    ``#### <gold>``, else 0.0. A final answer alone is not enough: it pays for steps that do not follow from each other
    (docs/design.md "The demo recipe")."""
    text = completion.strip()
    return float(check_solution(text) and text.split("\n")[-1].strip() == f"#### {str(gold).strip()}")
