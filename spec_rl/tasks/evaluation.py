"""Policy evaluation: sample fresh responses to held-out prompts and score them with a reward function.

Decoding goes through :class:`~spec_rl.backends.transformers_backend.TransformersBackend`, the same sampler the
rollouts use (exact temperature/top-k/top-p, the model's full EOS set, keyed sampling: the token at
position p of row i is a pure function of the seed, i, p and the logits, docs/design.md
"Randomness"), so an evaluation measures the policy the trainer actually samples from, gives the
same responses whatever the batch size, and leaves the caller's torch RNG alone. Nothing is read
from or written to a rollout cache.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from ..backends.protocol import Continuation, eos_token_ids
from ..backends.transformers_backend import TransformersBackend
from ..sampling.distribution import SamplingSettings
from .data import Example
from .demo_data import DEMO_MAX_NEW_TOKENS
from .rewards import RewardFn, math_reward

__all__ = ["evaluate_heldout", "evaluate_policy", "heldout_split"]


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _backend(model, tokenizer, batch_size: int) -> TransformersBackend:
    """A backend over ``model`` with the model's full EOS set; pad falls back to EOS as in the trainer."""
    eos_ids = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if not eos_ids or pad is None:
        raise ValueError("tokenizer needs eos_token_id and pad_token_id (set tokenizer.pad_token)")
    return TransformersBackend(model, eos_ids, pad, max_batch_size=int(batch_size), max_k=0)


def _generate(model, backend, calls) -> list[list[Continuation]]:
    """Run ``backend.generate(*args)`` for each argument tuple of ``calls`` with the model in eval mode."""
    was_training = model.training
    model.eval()
    try:
        return [backend.generate(*args) for args in calls]
    finally:
        if was_training:
            model.train()


def _rewards(tokenizer, outs: Sequence[Continuation], golds: Sequence[str], reward_fn: RewardFn) -> list[float]:
    """Reward of each response, decoded with special tokens (EOS) skipped."""
    return [float(reward_fn(tokenizer.decode(o.token_ids, skip_special_tokens=True), g)) for o, g in zip(outs, golds)]


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
    :class:`~spec_rl.backends.transformers_backend.TransformersBackend` with exactly the given
    sampling settings (defaults: temperature 1, top-k and top-p disabled);
    a response ends at any id of the model's EOS set
    (:func:`~spec_rl.backends.protocol.eos_token_ids`) or at the budget. Sampling is
    keyed by ``seed``, so the caller's torch RNG is untouched and equal seeds
    give equal results.

    Parameters
    ----------
    model : transformers causal LM
        Any device; put in eval mode for the call (its training mode is restored).
    tokenizer : transformers tokenizer
        Needs a pad or an EOS id (its own or the model's).
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
    backend = _backend(model, tokenizer, batch_size)
    contexts = [tokenizer(e.prompt, add_special_tokens=False)["input_ids"] for e in examples]
    (outs,) = _generate(model, backend, [(contexts, [settings.max_tokens] * len(contexts), settings, seed)])
    rewards = _rewards(tokenizer, outs, [e.answer for e in examples], reward_fn)
    n = len(outs)
    return {
        "mean_reward": sum(rewards) / n,
        "mean_response_tokens": sum(len(out.token_ids) for out in outs) / n,
        "truncated_fraction": sum(out.finish_reason != "eos" for out in outs) / n,
        "num_examples": n,
    }


def _heldout_budgets(
    prompts: Sequence[Sequence[int]], settings: SamplingSettings, max_model_len: int | None
) -> list[int]:
    """Per prompt: ``min(max_tokens, max_model_len - prompt_len)`` (the rollout's budget), at least 1 token."""
    if max_model_len is None:
        return [settings.max_tokens] * len(prompts)
    budgets = [settings.budget(len(p), max_model_len) for p in prompts]
    for i, b in enumerate(budgets):
        if b < 1:
            raise ValueError(
                f"held-out prompt {i} has {len(prompts[i])} tokens, max_model_len={max_model_len} leaves no room for a "
                "response; filter long prompts or raise max_model_len"
            )
    return budgets


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
) -> dict[str, float]:
    """Held-out quality of the current policy: fresh samples and greedy decoding (never from a cache).

    ``samples_per_prompt`` responses per prompt are sampled with the training sampling ``settings``,
    keyed by (``seed``, row = prompt index * samples_per_prompt + sample index), and one greedy
    response per prompt (top-k = 1, the same budget). This is the number to compare modes on: the
    rollout reward under reuse is biased towards drafts that were already correct. Prompts are
    encoded as :class:`~spec_rl.trainer.GRPOTrainer` encodes training prompts (``tokenizer(prompt)``).

    Parameters
    ----------
    model : transformers causal LM
        Put in eval mode for the call (its training mode is restored).
    tokenizer : transformers tokenizer
        Needs a pad or an EOS id.
    examples : sequence of Example
        Held-out prompts and gold answers.
    settings : SamplingSettings
        The training sampling settings; ``max_tokens`` is the response budget (tokens, EOS included).
    samples_per_prompt : int
        Fresh samples per prompt (>= 1).
    seed : int
        Sampling seed (the trainer derives one per epoch: :func:`spec_rl.trainer.heldout.heldout_seed`).
    batch_size : int
        Sequences per decode batch (>= 1); the results do not depend on it (keyed sampling).
    reward_fn : callable
        ``fn(response_text, gold) -> float``.
    max_model_len : int, optional
        Context limit: the budget is then ``min(max_tokens, max_model_len - prompt_len)``.
    samples_out : list, optional
        Receives one (prompt ids, sampled response ids) pair per fresh sample, for diagnostics.

    Returns
    -------
    dict
        ``heldout_reward`` (mean reward of the samples), ``heldout_greedy_accuracy`` (mean reward of
        the greedy responses), ``heldout_response_tokens`` (mean sampled response length, EOS
        included), ``heldout_prompts``.

    Raises
    ------
    ValueError
        Empty ``examples``, ``samples_per_prompt`` or ``batch_size`` < 1, no pad/EOS id, or a prompt
        that leaves no room for a response under ``max_model_len``.

    Example
    -------
    >>> r = evaluate_heldout(model, tok, demo_eval_set(), SamplingSettings(max_tokens=160), 4, seed=1)  # doctest: +SKIP
    >>> sorted(r)  # doctest: +SKIP
    ['heldout_greedy_accuracy', 'heldout_prompts', 'heldout_response_tokens', 'heldout_reward']
    """
    if not examples:
        raise ValueError("examples is empty; pass at least one held-out Example")
    _check_positive_int("samples_per_prompt", samples_per_prompt)
    _check_positive_int("batch_size", batch_size)
    backend = _backend(model, tokenizer, batch_size)
    prompts = [tokenizer(e.prompt)["input_ids"] for e in examples]
    budgets = _heldout_budgets(prompts, settings, max_model_len)
    greedy = SamplingSettings(top_k=1, max_tokens=settings.max_tokens)
    repeat = range(samples_per_prompt)
    sampled, argmax = _generate(
        model,
        backend,
        [
            ([p for p in prompts for _ in repeat], [b for b in budgets for _ in repeat], settings, seed),
            (prompts, budgets, greedy, seed),
        ],
    )
    rewards = _rewards(tokenizer, sampled, [e.answer for e in examples for _ in repeat], reward_fn)
    if samples_out is not None:
        samples_out.extend((p, list(o.token_ids)) for p, o in zip([p for p in prompts for _ in repeat], sampled))
    greedy_rewards = _rewards(tokenizer, argmax, [e.answer for e in examples], reward_fn)
    return {
        "heldout_reward": sum(rewards) / len(rewards),
        "heldout_greedy_accuracy": sum(greedy_rewards) / len(greedy_rewards),
        "heldout_response_tokens": sum(len(o.token_ids) for o in sampled) / len(sampled),
        "heldout_prompts": len(examples),
    }


def heldout_split(examples: Sequence[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Hold out ``fraction`` of the distinct prompts of ``examples``: (training examples, held-out examples).

    Examples with the same prompt text stay on one side, so no held-out prompt is trained on. Which
    prompts are held out is a pure function of the prompts and ``seed``; both parts keep the input order.

    Parameters
    ----------
    examples : sequence of Example
        The loaded training data (after any ``--limit``).
    fraction : float
        In (0, 1): the share of distinct prompts held out, rounded, at least one.
    seed : int
        Seeds the choice (the run seed).

    Returns
    -------
    tuple of list of Example
        (training part, held-out part), disjoint in prompt text, both non-empty.

    Raises
    ------
    ValueError
        ``fraction`` outside (0, 1), or fewer than two distinct prompts (one side would be empty).
    """
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
