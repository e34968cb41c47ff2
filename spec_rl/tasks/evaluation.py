"""Policy evaluation: fresh responses to held-out prompts, scored with a reward function; never a rollout cache.

Decoding uses the rollouts' sampler (:class:`~spec_rl.backends.transformers_backend.TransformersBackend`: exact
temperature/top-k/top-p, the model's full EOS set, keyed sampling, docs/design.md "Randomness"), so it measures the
policy the trainer samples from, gives the same responses at any batch size and leaves the torch RNG alone."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from ..backends.base import Continuation, fresh_jobs, policy_tokens
from ..backends.transformers_backend import TransformersBackend
from ..sampling.distribution import SamplingSettings
from ..util.validation import check_int
from .data import Example, PromptFormat
from .rewards import RewardFn, math_reward


def _backend(model, tokenizer, batch_size: int) -> TransformersBackend:
    """A backend over ``model`` with the model's full EOS set; pad falls back to EOS as in the trainer."""
    check_int("batch_size", batch_size, low=1)
    eos_ids, pad = policy_tokens(model, tokenizer)
    return TransformersBackend(model, eos_ids, pad, max_batch_size=int(batch_size))


def _generate(model, backend, calls) -> list[list[Continuation]]:
    """``backend.generate`` of each (contexts, budgets, settings, seed) of ``calls`` with the model in eval mode."""
    was_training = model.training
    model.eval()
    try:
        return [backend.generate(fresh_jobs(c, b), settings, seed) for c, b, settings, seed in calls]
    finally:
        model.train(was_training)


def _rewards(tokenizer, outs: Sequence[Continuation], golds: Sequence[str], reward_fn: RewardFn) -> list[float]:
    """Reward of each response, decoded with special tokens (EOS) skipped."""
    return [float(reward_fn(tokenizer.decode(o.token_ids, skip_special_tokens=True), g)) for o, g in zip(outs, golds)]


@torch.no_grad()
def evaluate_heldout(
    model,
    tokenizer,
    examples: Sequence[Example],
    settings: SamplingSettings,
    samples_per_prompt: int = 4,
    seed: int = 0,
    *,
    batch_size: int = 256,
    reward_fn: RewardFn = math_reward,
    max_model_len: int | None = None,
    samples_out: list | None = None,
    prompt_format: PromptFormat | None = None,
) -> dict[str, float]:
    """Held-out quality of the policy: ``samples_per_prompt`` fresh samples per prompt and one greedy response. Samples
    use the training ``settings`` keyed by (``seed``, row = prompt index * samples_per_prompt + sample); the greedy
    response (top-k = 1) has the same budget, ``min(max_tokens, max_model_len - prompt_len)`` tokens when
    ``max_model_len`` is given. Prompts are encoded as the trainer encodes them (``prompt_format``, default the plain
    prompt). ``samples_out`` receives one (prompt ids, response ids) pair per sample. Compare modes on this, not on
    the rollout reward, which reuse biases towards drafts that were already correct. Returns {"heldout_reward",
    "heldout_greedy_accuracy", "heldout_response_tokens" (EOS included), "heldout_prompts", "heldout_prompt_rewards" and
    "heldout_greedy_rewards" (per prompt)}. Raises ValueError for
    empty ``examples``, ``samples_per_prompt`` or ``batch_size`` < 1, no pad/EOS id, or a prompt that leaves no room
    for a response."""
    if not examples:
        raise ValueError("examples is empty; pass at least one held-out Example")
    check_int("samples_per_prompt", samples_per_prompt, low=1)
    backend = _backend(model, tokenizer, batch_size)
    prompts = (prompt_format or PromptFormat("off")).encode(tokenizer, examples)
    budgets = [
        settings.max_tokens if max_model_len is None else settings.budget(len(p), max_model_len, f"held-out prompt {i}")
        for i, p in enumerate(prompts)
    ]
    greedy = SamplingSettings(top_k=1, max_tokens=settings.max_tokens)
    repeat = range(samples_per_prompt)
    rows = [p for p in prompts for _ in repeat]
    row_budgets = [b for b in budgets for _ in repeat]
    sampled, argmax = _generate(model, backend, [(rows, row_budgets, settings, seed), (prompts, budgets, greedy, seed)])
    rewards = _rewards(tokenizer, sampled, [e.answer for e in examples for _ in repeat], reward_fn)
    if samples_out is not None:
        samples_out.extend((p, list(o.token_ids)) for p, o in zip(rows, sampled))
    greedy_rewards = _rewards(tokenizer, argmax, [e.answer for e in examples], reward_fn)
    return {
        "heldout_reward": sum(rewards) / len(rewards),
        "heldout_greedy_accuracy": sum(greedy_rewards) / len(greedy_rewards),
        "heldout_response_tokens": sum(len(o.token_ids) for o in sampled) / len(sampled),
        "heldout_prompts": len(examples),
        # per prompt, for intervals over problems (paired across runs: the same prompts and keys)
        "heldout_prompt_rewards": [
            round(sum(rewards[i : i + samples_per_prompt]) / samples_per_prompt, 6)
            for i in range(0, len(rewards), samples_per_prompt)
        ],
        "heldout_greedy_rewards": greedy_rewards,
    }


def heldout_split(examples: Sequence[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(training, held-out) examples: ``fraction`` of the distinct prompts (rounded, at least one) held out. Examples
    with the same prompt stay on one side; the choice is a pure function of the prompts and ``seed``, and both parts
    keep the input order. Raises ValueError for ``fraction`` outside (0, 1) or fewer than two distinct prompts."""
    if isinstance(fraction, bool) or not 0.0 < float(fraction) < 1.0:
        raise ValueError(f"the held-out fraction must be a number in (0, 1), got {fraction!r}")
    prompts = list(dict.fromkeys(e.prompt for e in examples))
    n_held = min(max(1, round(float(fraction) * len(prompts))), len(prompts) - 1)
    if n_held < 1:
        raise ValueError(
            f"{len(prompts)} distinct prompt(s) cannot be split into training and held-out prompts; "
            "pass more data or a separate held-out file"
        )
    order = list(range(len(prompts)))
    random.Random(int(seed)).shuffle(order)
    held = {prompts[i] for i in order[:n_held]}
    return [e for e in examples if e.prompt not in held], [e for e in examples if e.prompt in held]
