"""The demo model (a small Qwen2-architecture causal LM), its supervised warm start on worked solutions, and
:class:`DemoConfig`, everything that determines the checkpoint.

The SFT solutions carry arithmetic slips and a systematic "k + m" error, so the warm-started policy samples mistakes
that RL on the verifiable reward can remove (docs/design.md "The demo recipe"). Everything is deterministic given the
config, which the checkpoint cache relies on."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .arithmetic import TASK_VERSION
from .data import Example
from .demo_data import _EVAL_N, _TRAIN_N, DEMO_MAX_NEW_TOKENS, DEMO_TASK_OPTIONS, EVAL_SEED, TRAIN_SEED, demo_response

#: Bumped whenever the recipe (tokenizer, model, SFT) changes in a way the config hash would not see.
RECIPE_VERSION = 1


@dataclass(frozen=True)
class DemoConfig:
    """Everything that determines the demo checkpoint; :meth:`cache_key` names its cache folder. Model (Qwen2):
    ``num_heads``/``num_kv_heads`` (grouped-query attention), ``intermediate_size`` (MLP width),
    ``max_position_embeddings`` (tokens). Tokenizer: ``vocab_size`` (256 bytes + 2 specials + merges), trained on
    ``tokenizer_corpus`` problems. SFT: ``sft_examples`` problems (seed ``sft_seed``) with slips at ``slip_prob`` per
    written result and "k boxes with m in each" worked as k + m at ``misconception_prob``; ``sft_steps`` optimizer steps
    of ``batch_size`` sequences, peak ``lr`` after ``warmup_steps``, cosine decay to ``lr * min_lr_ratio``. ``seed``
    seeds model init and batch order."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 384
    vocab_size: int = 640
    tokenizer_corpus: int = 2000
    sft_examples: int = 8192
    sft_seed: int = 42
    slip_prob: float = 0.2
    misconception_prob: float = 0.6
    sft_steps: int = 700
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    seed: int = 0

    def cache_key(self) -> str:
        """12 hex digits of sha256 over the config, the task options and versions."""
        payload = {
            "config": dataclasses.asdict(self),
            "task": dict(DEMO_TASK_OPTIONS),
            "task_version": TASK_VERSION,
            "recipe_version": RECIPE_VERSION,
            "train_seed": TRAIN_SEED,
            "eval_seed": EVAL_SEED,
            # The SFT set excludes the train and held-out questions, so their sizes change the policy.
            "train_n": _TRAIN_N,
            "eval_n": _EVAL_N,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


# (prompt ids, response ids + EOS) of one SFT example.
Pair = tuple[list[int], list[int]]

# Labels at this value are ignored by the cross-entropy (transformers' convention).
_IGNORE_INDEX = -100
# Batches are drawn by length from windows of this many batches (less padding, still shuffled).
_BUCKET_BATCHES = 16
_MAX_GRAD_NORM = 1.0


def make_demo_model(cfg: DemoConfig, tokenizer):
    """A freshly initialised ``Qwen2ForCausalLM`` (init seeded with ``cfg.seed``) with tied embeddings, EOS as BOS,
    and a ``generation_config`` that samples plain softmax at temperature 1 for ``DEMO_MAX_NEW_TOKENS`` tokens."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos = tokenizer.eos_token_id
    special = dict(bos_token_id=eos, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    mcfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        **special,
    )
    torch.manual_seed(cfg.seed)
    model = Qwen2ForCausalLM(mcfg)
    model.generation_config = GenerationConfig(
        **special, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=DEMO_MAX_NEW_TOKENS
    )
    return model


def _collate(pairs: Sequence[Pair], pad_id: int):
    """Right-padded batch: input_ids/attention_mask/labels [B, S] int64 (labels ignored off the response)."""
    B, S = len(pairs), max(len(p) + len(r) for p, r in pairs)
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
    """One epoch of batches (index lists): shuffle, sort windows of batches by length, shuffle the batch order."""
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
    """Learning rate at ``step``: linear warm-up, then cosine decay to ``lr * min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.sft_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def run_sft(model, tokenizer, cfg: DemoConfig, examples: Sequence[Example], progress: bool) -> dict[str, Any]:
    """Warm-start ``model`` in place (left in eval mode) on the worked solutions of ``examples``. Input: prompt, then
    ``" " + solution + EOS``; cross-entropy on response tokens only, AdamW with linear warm-up and cosine decay,
    gradient clipping at 1.0. Returns {"sft_seconds", "first_loss", "final_loss" (mean of the last 10 steps), "steps"}.
    Raises ValueError when a sequence exceeds ``cfg.max_position_embeddings`` or an example has no solution."""
    from tqdm.auto import tqdm

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    # Prompt and response are tokenized separately, as a rollout sees them.
    data = [(ids(ex.prompt), ids(demo_response(ex)) + [tokenizer.eos_token_id]) for ex in examples]
    longest = max(len(p) + len(r) for p, r in data)
    if longest > cfg.max_position_embeddings:
        raise ValueError(
            f"an SFT sequence has {longest} tokens > max_position_embeddings={cfg.max_position_embeddings}; "
            "raise DemoConfig.max_position_embeddings"
        )
    rng = random.Random(cfg.seed)
    order: list[list[int]] = []
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]  # weight decay on matrices only, not on biases and norm scales
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)
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
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
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
