"""Held-out evaluation in the trainer: the warm start (epoch 0) and the policy after every epoch.

Each evaluation samples ``GRPOConfig.eval_samples`` fresh responses per held-out prompt with the
training sampling settings and decodes one greedy response per prompt
(:func:`spec_rl.tasks.evaluation.evaluate_heldout`); nothing comes from the rollout cache or the history.
Its seed is :func:`heldout_seed` (run seed, epoch): the same for every mode, so the modes of one run
are compared on the same uniforms (docs/design.md "Randomness"), and the warm-start evaluation of
every mode gives the same numbers.

Record layout (summary.json, trainer_state.json). The evaluation after epoch e is part of that
epoch's record::

    heldout_reward            mean reward of the fresh samples
    heldout_greedy_accuracy   mean reward of the greedy responses
    heldout_response_tokens   mean sampled response length (tokens, EOS included)
    heldout_entropy           mean per-token entropy of the policy on those samples (nats; :mod:`.diagnostics`)
    heldout_kl_to_init        mean per-token KL(policy || warm start) on those samples (nats)
    heldout_prompts           held-out prompts evaluated
    heldout_seed              the sampling seed used
    heldout_seconds           wall time of the evaluation

and the warm-start evaluation (epoch 0, before any update) goes into the record of epoch 1 under the
same names prefixed with ``start_`` (``start_heldout_reward``, ...). Records are checkpointed with
their epoch, so a resumed run neither redoes nor loses an evaluation. :func:`heldout_curve` reads
the points 0..E back. Runs without held-out examples have none of these fields.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ..sampling.distribution import SamplingSettings
from ..sampling.philox import mix_seed
from ..tasks.evaluation import evaluate_heldout
from .diagnostics import DIAGNOSTIC_FIELDS, policy_drift

__all__ = ["EVAL_BATCH_SIZE", "FIELDS", "START", "HeldoutEvaluator", "heldout_curve", "heldout_seed", "start_point"]

#: Salt of the held-out seeds: keeps their uniforms apart from the rollouts' (which use the run seed).
HELDOUT_SEED_SALT = 0x4E1D_0E7A
#: Sequences per decode batch. On the 2-core demo 128..640 cost the same (~3.4 s per evaluation of
#: 128 prompts x 4 samples + 128 greedy); 256 is the rollout's batch of 64 prompts x 4.
EVAL_BATCH_SIZE = 256
#: Fields one evaluation adds to a record.
FIELDS = (
    "heldout_reward",
    "heldout_greedy_accuracy",
    "heldout_response_tokens",
    *DIAGNOSTIC_FIELDS,
    "heldout_prompts",
    "heldout_seed",
    "heldout_seconds",
)
#: Prefix of the warm-start evaluation's fields in the first epoch record.
START = "start_"


def heldout_seed(run_seed: int, epoch: int) -> int:
    """Sampling seed of the held-out evaluation after ``epoch`` (0: the warm start); the same in every mode."""
    return mix_seed(int(run_seed) ^ HELDOUT_SEED_SALT, epoch)


class HeldoutEvaluator:
    """Evaluates a policy on fixed held-out examples with one keyed seed per epoch.

    Args:
        examples: held-out examples (``prompt``, ``answer``), none of them a training prompt.
        tokenizer: the policy's tokenizer.
        settings: the training sampling settings.
        samples_per_prompt: fresh samples per prompt (``GRPOConfig.eval_samples``).
        reward_fn: ``reward_fn(completion_text, gold_answer) -> float``, the training reward.
        run_seed: the run seed (``GRPOConfig.seed``).
        max_model_len: context limit (the budget is the rollout's).
        batch_size: sequences per decode batch.

    Raises:
        ValueError: no examples.
    """

    def __init__(
        self,
        examples: Sequence,
        tokenizer,
        settings: SamplingSettings,
        samples_per_prompt: int,
        reward_fn: Callable[[str, str], float],
        run_seed: int,
        max_model_len: int | None = None,
        batch_size: int = EVAL_BATCH_SIZE,
    ):
        if len(examples) == 0:
            raise ValueError("no held-out examples; pass at least one, or none to turn held-out evaluation off")
        self.examples = list(examples)
        self.tokenizer = tokenizer
        self.settings = settings
        self.samples_per_prompt = samples_per_prompt
        self.reward_fn = reward_fn
        self.run_seed = run_seed
        self.max_model_len = max_model_len
        self.batch_size = batch_size
        #: the initial policy (KL to the warm start) and the pad id of the diagnostics; set by the trainer
        self.reference = None
        self.pad_id: int | None = None

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
        )
        if self.pad_id is not None:
            prompts, responses = [p for p, _ in samples], [r for _, r in samples]
            result.update(
                policy_drift(model, self.reference, prompts, responses, self.pad_id, self.settings.temperature)
            )
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
