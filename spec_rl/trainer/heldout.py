"""Held-out evaluation in the trainer: the warm start (epoch 0) and the policy after every epoch.

Fresh samples plus one greedy response per prompt, never from the rollout cache. The seed depends on (run seed, epoch)
only, so all modes are evaluated on the same uniforms (docs/design.md "Randomness"). The evaluation after epoch e is
part of that epoch's record (:data:`FIELDS`); the warm start's is in epoch 1's, prefixed ``start_``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..sampling.distribution import SamplingSettings
from ..sampling.philox import SEED_SALT_HELDOUT, mix_seed
from ..tasks.data import PromptFormat
from ..tasks.evaluation import evaluate_heldout
from .diagnostics import DIAGNOSTIC_FIELDS, policy_drift

#: Salt of the held-out seeds: keeps their uniforms apart from the rollouts' (which use the run seed).
#: Sequences per decode batch (the rollout's batch of 64 prompts x 4 samples).
EVAL_BATCH_SIZE = 256
#: Fields one evaluation adds to a record.
FIELDS = (
    "heldout_reward",  # mean reward of the fresh samples
    "heldout_greedy_accuracy",  # mean reward of the greedy responses
    "heldout_response_tokens",  # mean sampled response length (tokens, EOS included)
    *DIAGNOSTIC_FIELDS,  # entropy and KL to the warm start (nats per token)
    "heldout_prompts",
    "heldout_prompt_rewards",  # per held-out prompt: mean reward of its fresh samples
    "heldout_greedy_rewards",  # per held-out prompt: reward of its greedy response
    "heldout_seed",
    "heldout_seconds",  # wall time of the evaluation
)
#: Prefix of the warm-start evaluation's fields in the first epoch record.
START = "start_"


def heldout_seed(run_seed: int, epoch: int) -> int:
    """Sampling seed of the held-out evaluation after ``epoch`` (0: the warm start); the same in every mode."""
    return mix_seed(int(run_seed) ^ SEED_SALT_HELDOUT, epoch)


@dataclass(eq=False)
class HeldoutEvaluator:
    """Evaluates a policy on fixed held-out examples with one keyed seed per epoch; ValueError without examples.
    ``settings``, ``reward_fn``: the training ones; ``max_model_len``: context limit (the budget is the rollout's)."""

    examples: Sequence
    tokenizer: Any
    settings: SamplingSettings
    samples_per_prompt: int
    reward_fn: Callable[[str, str], float]
    run_seed: int
    max_model_len: int | None = None
    batch_size: int = EVAL_BATCH_SIZE
    prompt_format: PromptFormat | None = None
    #: the initial policy and pad id of the diagnostics, set by the trainer
    reference: Any = None
    pad_id: int | None = None

    def __post_init__(self) -> None:
        if len(self.examples) == 0:
            raise ValueError("no held-out examples; pass at least one, or none to turn held-out evaluation off")
        self.examples = list(self.examples)

    def evaluate(self, model, epoch: int) -> dict:
        """The fields of :data:`FIELDS` for ``model`` as it is after ``epoch`` (0: before training)."""
        seed = heldout_seed(self.run_seed, epoch)
        t0 = time.perf_counter()
        samples: list = []
        result = evaluate_heldout(
            model,
            self.tokenizer,
            self.examples,
            self.settings,
            self.samples_per_prompt,
            seed,
            batch_size=self.batch_size,
            reward_fn=self.reward_fn,
            max_model_len=self.max_model_len,
            samples_out=samples,
            prompt_format=self.prompt_format,
        )
        if self.pad_id is not None:
            prompts, responses = [p for p, _ in samples], [r for _, r in samples]
            drift = policy_drift(model, self.reference, prompts, responses, self.pad_id, self.settings.temperature)
            result.update(drift)
        return {**result, "heldout_seed": seed, "heldout_seconds": time.perf_counter() - t0}


def start_point(records: Sequence[dict]) -> dict | None:
    """The warm-start evaluation as a record of epoch 0 (the :data:`FIELDS` without prefix), or None."""
    if not records or f"{START}heldout_reward" not in records[0]:
        return None
    first = records[0]
    return {"epoch": 0, **{k: first[START + k] for k in FIELDS if START + k in first}}


def heldout_curve(records: Sequence[dict]) -> list[dict]:
    """One point per evaluated epoch, 0 (warm start) first: ``epoch`` and the :data:`FIELDS` found."""
    start = start_point(records)
    points = [] if start is None else [start]
    for rec in records:
        if "heldout_reward" in rec:
            points.append({"epoch": rec["epoch"], **{k: rec[k] for k in FIELDS if k in rec}})
    return points
