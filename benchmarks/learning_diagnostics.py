"""Why a policy's greedy answers change under RL: failure breakdown, arithmetic by operation, gold accuracy.

    python benchmarks/learning_diagnostics.py POLICY [POLICY ...] [--problems 640] [--json PATH]

Each POLICY is a checkpoint folder or a run folder (``runs/<stamp>/vanilla``: its committed checkpoint);
``demo`` names the cached demo warm start. On ``--problems`` held-out demo problems (disjoint from the
train set), one greedy response per problem is classified as

* ``correct``: the final answer is right and every step is consistent (the task's own check,
  :func:`spec_rl.tasks.arithmetic.check_solution`);
* ``correct answer, inconsistent steps``: the final answer is right but some step is not (a slip
  compensated later, or an answer that does not follow from the steps);
* ``wrong arithmetic``: some equation ``a op b = c`` is false;
* ``steps do not chain``: every equation is true but one starts from another value than the
  previous result (a copy error);
* ``boxes worked as k + m``: a "k boxes with m in each" line adds k and m (the warm start's systematic
  error, docs/design.md "The demo recipe");
* ``consistent but wrong``: the steps are consistent yet the answer is wrong (the question misread otherwise);
* ``format``: no ``#### <answer>`` line.

It also prints the greedy error rate of every equation by operation and operand size, and the
teacher-forced accuracy (argmax == gold token) on the problems' gold worked solutions. These are the
measurements behind docs/design.md "The demo recipe".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter

import torch

from spec_rl.backends import fresh_jobs
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.tasks.arithmetic import check_solution, generate_problems
from spec_rl.tasks.demo_data import DEMO_MAX_NEW_TOKENS, DEMO_TASK_OPTIONS, EVAL_SEED, demo_response, demo_train_set
from spec_rl.tasks.evaluation import _backend
from spec_rl.tasks.rewards import math_reward
from spec_rl.trainer.run import load_policy

EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
BOXES_ADDED = re.compile(r"in each \w+, so \w+ has \d+ \+ \d+ = \d+ more")
_EXACT = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a // b if b and a % b == 0 else None,
}


def classify(text: str, gold: str) -> str:
    """The failure class of one response (module docstring)."""
    if not text.strip().split("\n")[-1].strip().startswith("####"):
        return "format"
    equations = [(int(a), op, int(b), int(c)) for a, op, b, c in EQUATION.findall(text)]
    arithmetic_ok = all(_EXACT[op](a, b) == c for a, op, b, c in equations)
    consistent = check_solution(text.strip())
    if math_reward(text, gold) > 0:
        return "correct" if consistent else "correct answer, inconsistent steps"
    if BOXES_ADDED.search(text):
        return "boxes worked as k + m"
    if not arithmetic_ok:
        return "wrong arithmetic"
    return "steps do not chain" if not consistent else "consistent but wrong"


def equation_errors(texts) -> dict[str, list[int]]:
    """{"<op> <1d|2d>": [equations, wrong ones]} over every equation of the responses."""
    counts: dict[str, list[int]] = {}
    for text in texts:
        for a, op, b, c in EQUATION.findall(text):
            a, b, c = int(a), int(b), int(c)
            exact = _EXACT[op](a, b)
            key = f"{op} {'2d' if max(a, b, exact or 0) >= 10 else '1d'}"
            row = counts.setdefault(key, [0, 0])
            row[0] += 1
            row[1] += int(exact != c)
    return counts


@torch.no_grad()
def gold_accuracy(model, tok, examples) -> float:
    """Teacher-forced argmax accuracy on the gold worked solutions (response tokens and EOS)."""
    hit = total = 0
    for e in examples:
        prompt = tok(e.prompt)["input_ids"]
        response = tok(demo_response(e), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        hit += int((logits.argmax(-1) == torch.tensor(response)).sum())
        total += len(response)
    return hit / total


def diagnose(path: str, examples) -> dict:
    """Greedy failure classes, equation error rates and gold accuracy of the policy at ``path``."""
    if path == "demo":
        from spec_rl.tasks.demo_policy import build_demo_policy

        path = str(build_demo_policy(progress=False))
    model, tok = load_policy(path)
    backend = _backend(model, tok, 256)
    greedy = SamplingSettings(top_k=1, max_tokens=DEMO_MAX_NEW_TOKENS)
    prompts = [tok(e.prompt)["input_ids"] for e in examples]
    outs = backend.generate(fresh_jobs(prompts, [DEMO_MAX_NEW_TOKENS] * len(examples)), greedy, 0)
    texts = [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    classes = Counter(classify(t, e.answer) for t, e in zip(texts, examples))
    return {
        "policy": path,
        "greedy": {k: v / len(examples) for k, v in sorted(classes.items())},
        "equations": equation_errors(texts),
        "gold_token_accuracy": gold_accuracy(model, tok, examples[:300]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("policies", nargs="+", help="checkpoint or run folders, or 'demo' (the cached warm start)")
    ap.add_argument("--problems", type=int, default=640, help="held-out problems (default 640)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.problems < 1:
        ap.error("--problems must be >= 1")
    train_q = {e.question for e in demo_train_set()}
    examples = generate_problems(args.problems, seed=EVAL_SEED, exclude=train_q, slip_prob=0.0, **DEMO_TASK_OPTIONS)
    results = []
    for path in args.policies:
        r = diagnose(path, examples)
        results.append(r)
        print(f"{path}: gold-token accuracy {r['gold_token_accuracy']:.4f}")
        print("  greedy: " + ", ".join(f"{k} {v:.3f}" for k, v in r["greedy"].items()))
        print(
            "  equation errors: " + ", ".join(f"{k} {w}/{n}" for k, (n, w) in sorted(r["equations"].items())),
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
