"""The demo model and its supervised warm-start (SFT).

:func:`make_demo_model` builds a small Qwen2-architecture causal LM
(``transformers.Qwen2Config``; by default 2 layers, hidden size 128, ~0.6M
parameters). :func:`run_sft` warm-starts it on worked solutions: input =
``format_prompt(question)`` followed by the response ``" " + solution + EOS``;
cross-entropy on response tokens only (prompt and padding masked), AdamW with
linear warm-up and cosine decay, gradient clipping at 1.0, fixed seed.

Some SFT solutions carry injected arithmetic slips (``DemoConfig.slip_prob``),
so the warm-started policy samples calibrated arithmetic mistakes: its greedy
answer is usually right but at temperature 1 it slips. Most "k boxes with m in
each" lines are worked as k + m (``DemoConfig.misconception_prob`` = 0.6: a
systematic teacher error), so the policy prefers the wrong rule there and
samples the right one 40% of the time. Both are what RL on the verifiable
reward removes; the misconception is what lets it raise greedy accuracy
(docs/design.md "The demo recipe").

Everything here is deterministic given the config: the same operations in the
same order give the same weights, which is what the checkpoint cache relies on.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from .data import Example
from .demo_config import DemoConfig
from .demo_data import DEMO_MAX_NEW_TOKENS, demo_response

__all__ = ["make_demo_model", "run_sft"]

# (prompt ids, response ids + EOS) of one SFT example.
Pair = tuple[list[int], list[int]]

# Labels at this value are ignored by the cross-entropy (transformers' convention).
_IGNORE_INDEX = -100
# Batches are drawn by length from windows of this many batches (less padding, still shuffled).
_BUCKET_BATCHES = 16
_MAX_GRAD_NORM = 1.0


def make_demo_model(cfg: DemoConfig, tokenizer):
    """A freshly initialised demo causal LM (init seeded with ``cfg.seed``).

    Parameters
    ----------
    cfg : DemoConfig
        Architecture sizes and the init seed.
    tokenizer : transformers tokenizer
        Gives the vocabulary size and the EOS (also used as BOS) and pad ids.

    Returns
    -------
    transformers.Qwen2ForCausalLM
        Tied input/output embeddings; its ``generation_config`` samples plain
        softmax at temperature 1 (no hidden top-k/top-p) for
        :data:`~spec_rl.tasks.demo_data.DEMO_MAX_NEW_TOKENS` tokens.
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    mcfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg.seed)
    model = Qwen2ForCausalLM(mcfg)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=DEMO_MAX_NEW_TOKENS,
    )
    return model


def _encode_sft(tokenizer, examples: Sequence[Example]) -> list[Pair]:
    """(prompt ids, response ids + EOS) per example; prompt and response tokenized separately,
    exactly as a rollout sees them (prompt ids, then generated ids)."""
    out = []
    eos = tokenizer.eos_token_id
    for ex in examples:
        p = tokenizer(ex.prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(demo_response(ex), add_special_tokens=False)["input_ids"] + [eos]
        out.append((p, r))
    return out


def _collate(pairs: Sequence[Pair], pad_id: int):
    """Right-padded batch: input_ids/attention_mask/labels [B, S] int64 (labels ignored off the response)."""
    S = max(len(p) + len(r) for p, r in pairs)
    B = len(pairs)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    mask = torch.zeros((B, S), dtype=torch.long)
    labels = torch.full((B, S), _IGNORE_INDEX, dtype=torch.long)
    for i, (p, r) in enumerate(pairs):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r)
        mask[i, :n] = 1
        labels[i, len(p) : n] = torch.tensor(r)
    return ids, mask, labels


def _bucketed_batches(data: Sequence[Pair], batch_size: int, rng: random.Random) -> list[list[int]]:
    """One epoch of batches (lists of indices): shuffle, sort windows of batches by length
    (less padding), shuffle the batch order. Returned as a stack (pop from the end)."""
    perm = list(range(len(data)))
    rng.shuffle(perm)
    chunk = _BUCKET_BATCHES * batch_size
    batches = []
    for c in range(0, len(perm), chunk):
        part = sorted(perm[c : c + chunk], key=lambda i: len(data[i][0]) + len(data[i][1]))
        batches.extend(part[b : b + batch_size] for b in range(0, len(part), batch_size))
    batches = [b for b in batches if len(b) == batch_size] or batches
    rng.shuffle(batches)
    return batches


def _lr_at(step: int, cfg: DemoConfig) -> float:
    """Learning rate of optimizer step ``step``: linear warm-up, then cosine decay to ``lr * min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.sft_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _adamw(params: list[torch.nn.Parameter], cfg: DemoConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (biases and norm scales are not decayed)."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )


def _check_fits(data: Sequence[Pair], cfg: DemoConfig) -> None:
    longest = max(len(p) + len(r) for p, r in data)
    if longest > cfg.max_position_embeddings:
        raise ValueError(
            f"an SFT sequence has {longest} tokens > max_position_embeddings={cfg.max_position_embeddings}; "
            "raise DemoConfig.max_position_embeddings"
        )


def run_sft(model, tokenizer, cfg: DemoConfig, examples: Sequence[Example], progress: bool) -> dict[str, Any]:
    """Warm-start ``model`` in place on worked solutions (see the module docstring for the recipe).

    Parameters
    ----------
    model : transformers causal LM
        Trained in place; left in eval mode.
    tokenizer : transformers tokenizer
        Encodes prompts and responses (needs ``eos_token_id``, ``pad_token_id``).
    cfg : DemoConfig
        Steps, batch size, learning-rate schedule, weight decay and batch-order seed.
    examples : sequence of Example
        SFT problems with worked solutions.
    progress : bool
        Show a tqdm bar with the running loss.

    Returns
    -------
    dict
        ``sft_seconds`` (wall time), ``first_loss``, ``final_loss`` (mean of
        the last 10 steps), ``steps``.

    Raises
    ------
    ValueError
        An SFT sequence is longer than ``cfg.max_position_embeddings``, or an
        example has no solution.
    """
    from tqdm.auto import tqdm

    data = _encode_sft(tokenizer, examples)
    _check_fits(data, cfg)
    rng = random.Random(cfg.seed)
    order: list[list[int]] = []
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _adamw(params, cfg)
    model.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.sft_steps), desc="demo policy SFT", disable=not progress, unit="step", leave=False)
    for step in bar:
        if not order:
            order = _bucketed_batches(data, cfg.batch_size, rng)
        idx = order.pop()
        ids, mask, labels = _collate([data[i] for i in idx], tokenizer.pad_token_id)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, _MAX_GRAD_NORM)
        opt.step()
        losses.append(float(loss.detach()))
        if progress:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    model.eval()
    tail = losses[-10:]
    return {
        "sft_seconds": time.perf_counter() - t0,
        "first_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        "steps": cfg.sft_steps,
    }
