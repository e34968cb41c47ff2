"""Procedurally generated multi-step arithmetic word problems in GSM8K format.

Each problem follows one person's stock of some item through a few events
(buying or finding more, giving some away, buying k boxes of m, doubling or
tripling, splitting into equal groups) and asks how many there are at the
end. Events open with fixed connectives ("First,", "Then", "Next,",
"Finally,"). The worked solution restates the start and each event after the
same connective, with one short equation per event (two for "k boxes of m"),
and ends with ``#### <n>``, the answer format of GSM8K (Cobbe et al. 2021,
arXiv 2110.14168)::

    Question: Leo has 16 books. First, he splits his books into 2 equal groups
    and keeps one group. Then he buys 5 boxes with 8 books in each box. Finally,
    he loses 3 books. How many books does Leo have now?
    Answer: Leo has 16 books.
    First, he splits his books into 2 equal groups and keeps one group, so he has 16 / 2 = 8 books.
    Then he buys 5 boxes with 8 books in each box, so he has 5 * 8 = 40 more, and 8 + 40 = 48 books.
    Finally, he loses 3 books, so he has 48 - 3 = 45 books.
    #### 45

Design for a sub-million-parameter learner (our own procedure, not taken
from any dataset): counts stay in 1..``max_value`` and divisions are exact;
restating each event after its connective turns "which event is next" into
an induction-style copy; digits are tokenized one by one by the demo
tokenizer. Optional *slips* (``slip_prob``) make some worked solutions
contain a result off by 1 or 2, and an optional *misconception*
(``misconception_prob``) works "k boxes with m in each" as k + m; both are
used for the demo policy's warm start (docs/design.md "The demo recipe").

Generation is deterministic given the seed: it uses only ``random.Random(seed)``
(``randrange``/``choice``/``random``, whose output sequences Python keeps stable).
"""

from __future__ import annotations

import random
import re

from .data import Example, format_prompt

__all__ = ["arithmetic_reward", "check_solution", "generate_problems", "TASK_VERSION"]

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


def _plural(container: str) -> str:
    return _CONTAINER_PLURAL.get(container, container + "s")


# Connectives that open each event sentence, by number of events. The
# solution restates each event after the same connective, so the model can
# find the event it is working on by matching the connective (an induction
# pattern) instead of counting sentences.
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
    options = []
    if hi + 1 <= max_value:
        options.append("add")
    if hi + 4 <= max_value:
        options.append("group")
    if lo >= 2:
        options.append("sub")
    if 2 * hi <= max_value:
        options.append("scale")
    if _share_divisors(x, w):
        options.append("share")
    return options


def _one_problem(
    rng: random.Random,
    steps: int,
    max_value: int,
    max_operand: int,
    slip_prob: float = 0.0,
    misconception_prob: float = 0.0,
):
    """Return (question, solution, answer) for one problem, or None if the draw hit a dead end.

    ``x`` is the true count (it defines the question and the answer); ``w`` is
    the count the worked solution believes (equal to ``x`` unless a slip or the
    misconception was injected). Every event is chosen to be valid for both.
    """

    def slip(v: int) -> int:
        if slip_prob and rng.random() < slip_prob:
            choices = [v + d for d in _SLIPS if 1 <= v + d <= max_value]
            return rng.choice(choices)
        return v

    name, he, his = rng.choice(_NAMES)
    obj, container = rng.choice(_OBJECTS)
    x = rng.randrange(2, min(max_operand, max_value) + 1)
    w = x
    opening = f"{name} has {x} {obj}."
    q_parts = [opening]
    s_lines = [opening]
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
            # k containers of m items each, with count + k*m <= max_value.
            pairs = [(k, m) for k in range(2, 6) for m in range(2, 10) if hi + k * m <= max_value]
            k, m = rng.choice(pairs)
            if misconception_prob and rng.random() < misconception_prob:
                sign, p = "+", k + m  # the teacher's systematic error: adds the two numbers
            else:
                sign, p = "*", slip(k * m)
            x, wy = x + k * m, slip(w + p)
            event = f"{he} buys {k} {_plural(container)} with {m} {obj} in each {container}"
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
    """Generate ``n`` arithmetic word problems with worked GSM8K-style solutions.

    Args:
        n: number of problems (>= 0).
        seed: RNG seed; the same (n, seed, options) always give the same problems.
        min_steps, max_steps: number of events per problem, 1 <= min <= max
            (each event is one solution line; "group" lines hold two equations).
        max_value: every count in the story stays in 1..max_value (>= 10).
        max_operand: largest number added, subtracted or used as a start (>= 2).
        unique: skip problems whose question text was already generated.
        exclude: question texts to skip (e.g. another split's, to keep splits disjoint).
        slip_prob: probability in [0, 1) that each result written in the worked
            solution is off by 1 or 2 (an "arithmetic slip"); later lines continue
            from the slipped value, so such a solution ends in a wrong ``#### n``
            while ``answer`` stays the true answer. 0 (default) gives correct
            solutions and consumes no extra randomness. Used to give the demo
            policy calibrated arithmetic noise that RL can remove.
        misconception_prob: probability in [0, 1) that a "k boxes with m in each"
            line is worked as ``k + m`` instead of ``k * m`` (a *systematic*
            error, unlike slips: above 0.5 it is the rule the solutions follow
            most often, so a model trained on them prefers it, and a right
            answer needs the rarer rule). 0 (default) consumes no randomness.

    Returns:
        list of ``n`` :class:`~spec_rl.tasks.data.Example` with ``prompt =
        format_prompt(question)``, ``answer`` the final count as a decimal
        string, ``solution`` ending in ``"#### <answer>"`` (unless a slip or
        the misconception changed a result), ``source="arith"``
        and ``uid = f"arith:{seed}:{i}"`` (i = index in the returned list).

    Raises:
        ValueError: a bad argument (the message names it), or the options
            cannot produce ``n`` distinct problems.
    """
    for arg, val in (
        ("n", n),
        ("seed", seed),
        ("min_steps", min_steps),
        ("max_steps", max_steps),
        ("max_value", max_value),
        ("max_operand", max_operand),
    ):
        if isinstance(val, bool) or not isinstance(val, int):
            raise ValueError(f"{arg} must be an int, got {val!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 1 <= min_steps <= max_steps <= MAX_STEPS:
        raise ValueError(
            f"need 1 <= min_steps <= max_steps <= {MAX_STEPS}, got min_steps={min_steps}, max_steps={max_steps}"
        )
    if max_value < 10:
        raise ValueError(f"max_value must be >= 10, got {max_value}")
    if max_operand < 2:
        raise ValueError(f"max_operand must be >= 2, got {max_operand}")
    for name, prob in (("slip_prob", slip_prob), ("misconception_prob", misconception_prob)):
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0.0 <= prob < 1.0:
            raise ValueError(f"{name} must be a float in [0, 1), got {prob!r}")
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
        if unique or exclude:
            if question in seen:
                continue
            seen.add(question)
        out.append(
            Example(
                prompt=format_prompt(question),
                answer=answer,
                uid=f"arith:{seed}:{len(out)}",
                source="arith",
                solution=solution,
                question=question,
            )
        )
    return out


_EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def check_solution(solution: str) -> bool:
    """True if a worked solution in this task's format is consistent.

    Checks that every equation ``a op b = c`` is arithmetically correct
    (division exact), that the equations chain (each line's last equation
    starts from the previous line's result, the first from the start count
    in line 1; in a "group" line the second equation adds the first one's
    result), and that the last line is ``#### <final result>``.
    """
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
    """The demo task's verifiable reward: 1.0 when the worked solution is consistent and ends in the gold answer.

    Every step is checked (:func:`check_solution`: each equation true, each line starting from the
    previous result) and the last line must be ``#### <gold>``; else 0.0. A final answer alone is not
    enough: on this task a slip propagates to the answer, so a right answer after a slip means steps
    that do not follow from each other, and a final-answer-only reward pays for exactly that
    (docs/design.md "The demo recipe").

    Args:
        completion: the response text (special tokens removed).
        gold: the gold final answer, e.g. ``"45"``.
    """
    text = completion.strip()
    return float(check_solution(text) and text.split("\n")[-1].strip() == f"#### {str(gold).strip()}")
