"""Policy evaluation: sample fresh responses to held-out prompts and score them with a reward function.

Decoding goes through :class:`~spec_rl.generation.TransformersBackend`, the
same sampler the rollouts use (exact temperature/top-k/top-p, the model's full
EOS set, a private seeded generator), so an evaluation measures the policy
the trainer actually samples from.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .data import Example
from .generation import TransformersBackend, eos_token_ids
from .rewards import RewardFn, math_reward
from .sampling import SamplingSettings
from .tasks.demo_data import DEMO_MAX_NEW_TOKENS

__all__ = ["evaluate_heldout", "evaluate_policy"]


def _check_positive_int(name: str, value) -> None:
    if int(value) != value or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@torch.no_grad()
def evaluate_policy(
    model,
    tokenizer,
    examples: Sequence[Example],
    max_new_tokens: int = DEMO_MAX_NEW_TOKENS,
    seed: int = 0,
    *,
    batch_size: int = 64,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    reward_fn: RewardFn = math_reward,
) -> dict[str, float]:
    """Sample one response per example and score it.

    Prompts are encoded without special tokens and decoded by
    :class:`~spec_rl.generation.TransformersBackend` with exactly the given
    sampling settings (defaults: temperature 1, top-k and top-p disabled);
    a response ends at any id of the model's EOS set
    (:func:`~spec_rl.generation.eos_token_ids`) or at the budget. Sampling
    uses a generator seeded with ``seed``, so the caller's torch RNG is
    untouched and equal seeds give equal results.

    Parameters
    ----------
    model : transformers causal LM
        Any device; put in eval mode for the call (its training mode is restored).
    tokenizer : transformers tokenizer
        Needs ``pad_token_id`` and an EOS id (its own or the model's).
    examples : sequence of Example
        Prompts and gold answers.
    max_new_tokens : int
        Response budget in tokens, EOS included (>= 1).
    seed : int
        Sampling seed.
    batch_size : int
        Prompts per decode batch (>= 1).
    temperature, top_k, top_p : float, int, float
        Sampling settings (``top_k=0`` / ``top_p=1`` disable).
    reward_fn : callable
        ``fn(response_text, gold) -> float``; the response is decoded with
        special tokens (EOS) skipped.

    Returns
    -------
    dict
        ``mean_reward`` (float), ``mean_response_tokens`` (tokens per
        response, EOS included), ``truncated_fraction`` (responses without EOS
        within the budget), ``num_examples``.

    Raises
    ------
    ValueError
        Empty ``examples``, ``max_new_tokens`` < 1, ``batch_size`` < 1, bad
        sampling settings, or no pad/EOS id.

    Example
    -------
    >>> r = evaluate_policy(model, tok, demo_eval_set(), seed=0)  # doctest: +SKIP
    >>> sorted(r)  # doctest: +SKIP
    ['mean_response_tokens', 'mean_reward', 'num_examples', 'truncated_fraction']
    """
    if not examples:
        raise ValueError("examples is empty; pass at least one Example")
    _check_positive_int("max_new_tokens", max_new_tokens)
    _check_positive_int("batch_size", batch_size)
    settings = SamplingSettings(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=int(max_new_tokens))
    eos_ids, pad = eos_token_ids(model, tokenizer), tokenizer.pad_token_id
    if not eos_ids or pad is None:
        raise ValueError("tokenizer needs eos_token_id and pad_token_id (set tokenizer.pad_token)")
    backend = TransformersBackend(model, eos_ids, pad, max_batch_size=int(batch_size))
    contexts = [tokenizer(e.prompt, add_special_tokens=False)["input_ids"] for e in examples]
    was_training = model.training
    model.eval()
    try:
        outs = backend.generate(contexts, [settings.max_tokens] * len(contexts), settings, seed)
    finally:
        if was_training:
            model.train()
    rewards = [
        float(reward_fn(tokenizer.decode(out.token_ids, skip_special_tokens=True), ex.answer))
        for ex, out in zip(examples, outs)
    ]
    n = len(outs)
    return {
        "mean_reward": sum(rewards) / n,
        "mean_response_tokens": sum(len(out.token_ids) for out in outs) / n,
        "truncated_fraction": sum(out.finish_reason != "eos" for out in outs) / n,
        "num_examples": n,
    }


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
) -> dict[str, float]:
    """Held-out quality of the current policy: fresh samples and greedy decoding (never from a cache).

    ``samples_per_prompt`` responses per prompt are sampled with the training sampling ``settings``
    (keyed by (seed, prompt index, sample index)), and one greedy response per prompt (top-k = 1,
    the same budget). This is the number to compare modes on: the rollout reward under reuse is
    biased towards drafts that were already correct.

    Returns
    -------
    dict
        ``heldout_reward`` (mean reward of the samples), ``heldout_greedy_accuracy`` (mean reward of
        the greedy responses), ``heldout_response_tokens`` (mean sampled response length, EOS
        included), ``heldout_prompts``.

    Raises
    ------
    ValueError
        Empty ``examples``, ``samples_per_prompt`` or ``batch_size`` < 1, or no pad/EOS id.
    """
    if not examples:
        raise ValueError("examples is empty; pass at least one held-out Example")
    _check_positive_int("samples_per_prompt", samples_per_prompt)
    _check_positive_int("batch_size", batch_size)
    eos_ids, pad = eos_token_ids(model, tokenizer), tokenizer.pad_token_id
    if not eos_ids or pad is None:
        raise ValueError("tokenizer needs eos_token_id and pad_token_id (set tokenizer.pad_token)")
    backend = TransformersBackend(model, eos_ids, pad, max_batch_size=int(batch_size), max_k=0)
    prompts = [tokenizer(e.prompt, add_special_tokens=False)["input_ids"] for e in examples]
    greedy = SamplingSettings(top_k=1, max_tokens=settings.max_tokens)
    was_training = model.training
    model.eval()
    try:
        contexts = [p for p in prompts for _ in range(samples_per_prompt)]
        sampled = backend.generate(contexts, [settings.max_tokens] * len(contexts), settings, seed)
        argmax = backend.generate(prompts, [settings.max_tokens] * len(prompts), greedy, seed)
    finally:
        if was_training:
            model.train()

    def score(outs, golds) -> list[float]:
        return [float(reward_fn(tokenizer.decode(o.token_ids, skip_special_tokens=True), g)) for o, g in zip(outs, golds)]

    rewards = score(sampled, [e.answer for e in examples for _ in range(samples_per_prompt)])
    greedy_rewards = score(argmax, [e.answer for e in examples])
    return {
        "heldout_reward": sum(rewards) / len(rewards),
        "heldout_greedy_accuracy": sum(greedy_rewards) / len(greedy_rewards),
        "heldout_response_tokens": sum(len(o.token_ids) for o in sampled) / len(sampled),
        "heldout_prompts": len(examples),
    }
