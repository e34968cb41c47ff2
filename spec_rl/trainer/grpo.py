"""A small GRPO trainer whose rollouts go through :class:`~spec_rl.rollout.SpeculativeRollout`."""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..cache import RolloutCache
from ..history import HistoryIndex
from ..generation import TransformersBackend, eos_token_ids
from ..rollout import RolloutRequest, RolloutResult, SpeculativeRollout
from ..sampling import SamplingSettings
from ..scoring import response_logprobs
from .config import GRPOConfig
from .loss import clipped_policy_loss, group_advantages, response_mask

CACHE_FILE = "rollout_cache.safetensors"
HISTORY_FILE = "history.safetensors"
# Seeds of the per-step mini-batch split and the per-epoch prompt order: seed * stride + counter,
# with prime strides so (seed, counter) pairs of nearby runs do not collide.
_MINIBATCH_SEED_STRIDE = 1_000_003
_EPOCH_SEED_STRIDE = 7919
CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "trainer_state.json"

# Per-epoch fields summed over steps; the rest are derived in _epoch_record.
_SUMMED = (
    "num_samples",
    "drafts_found",
    "draft_tokens",
    "accepted_tokens",
    "full_reuse_count",
    "tokens_generated",
    "vanilla_tokens",
    "scoring_seconds",
    "generation_seconds",
    "assembly_seconds",
    "decode_steps",
    "tail_proposed",
    "tail_accepted",
    "reward_sum",
    "truncated",
    "train_seconds",
    "steps",
)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class GRPOTrainer:
    """GRPO (group-normalised advantages, clipped loss) with speculative rollouts.

    Args:
        model: a transformers causal LM (trained in place).
        tokenizer: its tokenizer (used to encode prompts and decode responses).
        train_examples: objects with ``prompt`` (str), ``answer`` (str) and
            ``uid`` (str, a stable dataset id) attributes, e.g.
            :class:`spec_rl.data.Example`.
        reward_fn: ``reward_fn(completion_text, gold_answer) -> float``.
        config: :class:`GRPOConfig`.
        out_dir: run directory (metrics.jsonl, checkpoint/, rollout cache).
        progress: show a tqdm progress bar.
        log: callable for one-line messages (default print).
        label: name of this run in records and reports (default ``config.mode``).
    """

    def __init__(
        self,
        model,
        tokenizer,
        train_examples: Sequence,
        reward_fn: Callable[[str, str], float],
        config: GRPOConfig,
        out_dir: str | os.PathLike,
        progress: bool = True,
        log: Callable[[str], None] = print,
        label: str | None = None,
    ):
        if len(train_examples) == 0:
            raise ValueError("train_examples is empty; give the trainer at least one prompt")
        self.config = config
        self.device = resolve_device(config.device)
        self.model = model.to(self.device)
        self.tokenizer = tokenizer
        self.examples = list(train_examples)
        self.reward_fn = reward_fn
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.progress = progress
        self.log = log
        self.label = label or config.mode

        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.pad_id is None:
            raise ValueError("the tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token")
        self.eos_ids = eos_token_ids(model, tokenizer)
        if not self.eos_ids:
            raise ValueError("no EOS id found in the model's generation_config/config or the tokenizer; set eos_token_id")
        max_model_len = config.max_model_len or getattr(model.config, "max_position_embeddings", None)
        if not max_model_len:
            raise ValueError("cannot infer max_model_len from the model config; set GRPOConfig.max_model_len")
        self.settings = SamplingSettings(
            temperature=config.temperature, top_p=config.top_p, top_k=config.top_k, max_tokens=config.max_response_len
        )
        self.prompt_ids = [tokenizer(e.prompt)["input_ids"] for e in self.examples]
        for e, ids in zip(self.examples, self.prompt_ids):
            if len(ids) >= max_model_len:
                raise ValueError(
                    f"prompt {e.uid!r} has {len(ids)} tokens, not less than max_model_len={max_model_len}; "
                    "filter long prompts or raise max_model_len"
                )

        self.cache = RolloutCache()
        self.history = HistoryIndex() if config.uses_history else None
        self.rollout = SpeculativeRollout(
            backend=self._make_backend(model, config),
            cache=self.cache,
            settings=self.settings,
            eos_ids=sorted(self.eos_ids),
            max_model_len=max_model_len,
            lenience=config.lenience,
            strategy=config.rollout_strategy,
            seed=config.seed,
            acceptance=config.acceptance,
            history=self.history,
        )
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.ref_model = None
        if config.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.step = 0
        self.start_epoch = 0
        self.metrics_path = self.out_dir / "metrics.jsonl"

    def _make_backend(self, model, config: GRPOConfig):
        """The generation backend named by ``config.generation_backend`` ("auto": paged on CUDA)."""
        choice = config.generation_backend
        if choice == "auto":
            choice = "paged" if next(model.parameters()).device.type == "cuda" else "transformers"
        if choice == "paged":
            from ..engine import PagedEngine

            return PagedEngine(model, self.eos_ids, self.pad_id, max_k=config.spec_tokens)
        return TransformersBackend(model, self.eos_ids, self.pad_id, max_k=config.spec_tokens)

    # ------------------------------------------------------------- resume
    def resume(self) -> bool:
        """Restore optimizer, counters and rollout cache from ``out_dir`` if a checkpoint exists.

        The model weights must already be loaded from ``out_dir/checkpoint``
        by the caller (see :func:`spec_rl.trainer.run.load_policy`).
        Returns True when a checkpoint was found.
        """
        ckpt = self.out_dir / CHECKPOINT_DIR
        if not (ckpt / STATE_FILE).is_file():
            return False
        state = json.loads((ckpt / STATE_FILE).read_text())
        self.step = int(state["step"])
        self.start_epoch = int(state["epoch"]) + 1
        opt_path = ckpt / "optimizer.pt"
        if opt_path.is_file():
            self.optimizer.load_state_dict(torch.load(opt_path, map_location=self.device, weights_only=True))
        cache_path = self.out_dir / CACHE_FILE
        if cache_path.is_file():
            self.cache.update(RolloutCache.load(cache_path))
        history_path = self.out_dir / HISTORY_FILE
        if self.history is not None and history_path.is_file():
            self.history.update(HistoryIndex.load(history_path))
        return True

    def _save(self, epoch: int) -> None:
        """Checkpoint (transformers format) + optimizer + state, then the cache; each written atomically."""
        final = self.out_dir / CHECKPOINT_DIR
        tmp = self.out_dir / f".{CHECKPOINT_DIR}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        self.model.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        (tmp / STATE_FILE).write_text(json.dumps({"epoch": epoch, "step": self.step, "config": self.config.to_dict()}))
        old = self.out_dir / f".{CHECKPOINT_DIR}.old"
        if old.exists():
            shutil.rmtree(old)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        if old.exists():
            shutil.rmtree(old)
        self.cache.save(self.out_dir / CACHE_FILE)
        if self.history is not None:
            self.history.save(self.out_dir / HISTORY_FILE)

    # ------------------------------------------------------------- training
    def _update(self, result: RolloutResult, advantages: torch.Tensor) -> dict[str, float]:
        cfg = self.config
        self.model.train()
        masks = response_mask(result.response_ids, self.eos_ids)
        order = list(range(len(result.response_ids)))
        random.Random(cfg.seed * _MINIBATCH_SEED_STRIDE + self.step).shuffle(order)
        minis = [order[i :: cfg.ppo_mini_batches] for i in range(cfg.ppo_mini_batches)]
        losses, clip_fracs = [], []
        for mini in minis:
            num_tokens = int(masks[mini].sum())
            if cfg.kl_coef == 0:
                # Zero-advantage samples add nothing to the gradient; they still count in the token mean.
                mini = [i for i in mini if float(advantages[i]) != 0.0]
            if not mini or num_tokens == 0:
                continue
            self.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for start in range(0, len(mini), cfg.micro_batch_size):
                idx = mini[start : start + cfg.micro_batch_size]
                prompts = [result.prompt_ids[i] for i in idx]
                resps = [result.response_ids[i] for i in idx]
                lp = response_logprobs(self.model, prompts, resps, self.pad_id, cfg.temperature, cfg.top_k, cfg.top_p)
                width = lp.shape[1]
                mask = masks[idx][:, :width].to(self.device)
                old = torch.zeros_like(lp)
                for row, i in enumerate(idx):
                    old[row, : len(result.logprobs[i])] = torch.tensor(result.logprobs[i], device=self.device)
                ref = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref = response_logprobs(self.ref_model, prompts, resps, self.pad_id, cfg.temperature, cfg.top_k, cfg.top_p)
                loss, m = clipped_policy_loss(
                    lp,
                    old,
                    advantages[idx].to(self.device),
                    mask,
                    cfg.clip_low,
                    cfg.clip_high,
                    ref_logprobs=ref,
                    kl_coef=cfg.kl_coef,
                    num_tokens=num_tokens,
                )
                loss.backward()
                total += float(loss.detach())
                clip_fracs.append(m["clip_frac"])
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            self.optimizer.step()
            losses.append(total)
        self.model.eval()
        return {
            "loss": sum(losses) / len(losses) if losses else 0.0,
            "clip_frac": sum(clip_fracs) / len(clip_fracs) if clip_fracs else 0.0,
        }

    def train_step(self, batch_indices: Sequence[int], epoch: int) -> dict:
        """One rollout + reward + policy update over the given example indices."""
        cfg = self.config
        requests = [
            RolloutRequest(self.prompt_ids[i], slot, dataset_id=self.examples[i].uid)
            for i in batch_indices
            for slot in range(cfg.group_size)
        ]
        self.model.eval()
        result = self.rollout.run(requests, self.step)
        texts = self.tokenizer.batch_decode(result.response_ids, skip_special_tokens=True)
        golds = [self.examples[i].answer for i in batch_indices for _ in range(cfg.group_size)]
        rewards = torch.tensor([float(self.reward_fn(t, g)) for t, g in zip(texts, golds)])
        advantages = group_advantages(rewards, cfg.group_size, cfg.scale_adv_by_std)
        t0 = time.perf_counter()
        upd = self._update(result, advantages)
        train_seconds = time.perf_counter() - t0
        record = {
            "mode": self.label,
            "acceptance": cfg.acceptance,
            "history_spec": cfg.uses_history,
            "lenience": cfg.lenience,
            "epoch": epoch,
            "step": self.step,
            "mean_reward": float(rewards.mean()),
            "reward_sum": float(rewards.sum()),
            "mean_response_len": sum(len(r) for r in result.response_ids) / len(result.response_ids),
            "truncated": sum(result.truncated),
            "train_seconds": train_seconds,
            **result.stats.to_dict(),
            **upd,
        }
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.step += 1
        return record

    @staticmethod
    def _epoch_record(epoch: int, steps: list[dict], mode: str, lenience: float, acceptance: str = "lenient") -> dict:
        tot = {k: sum(s.get(k, 0) for s in steps) for k in _SUMMED if k != "steps"}
        n = max(tot["num_samples"], 1)
        return {
            "mode": mode,
            "lenience": lenience,
            "epoch": epoch,
            "steps": len(steps),
            "samples": tot["num_samples"],
            "mean_reward": tot["reward_sum"] / n,
            "generated_tokens": tot["tokens_generated"],
            "reused_tokens": tot["accepted_tokens"],
            "vanilla_tokens": tot["vanilla_tokens"],
            "draft_tokens": tot["draft_tokens"],
            "drafts_found": tot["drafts_found"],
            "full_reuse_ratio": tot["full_reuse_count"] / n,
            "mean_verified_prefix": tot["accepted_tokens"] / tot["drafts_found"] if tot["drafts_found"] else 0.0,
            "mean_response_len": tot["vanilla_tokens"] / n,
            "truncated_frac": tot["truncated"] / n,
            "rollout_seconds": tot["scoring_seconds"] + tot["generation_seconds"] + tot["assembly_seconds"],
            "scoring_seconds": tot["scoring_seconds"],
            "generation_seconds": tot["generation_seconds"],
            "other_seconds": tot["assembly_seconds"],
            "decode_steps": tot["decode_steps"],
            "longest_continuation": max((s.get("longest_continuation", 0) for s in steps), default=0),
            "tail_proposed": tot["tail_proposed"],
            "tail_accepted": tot["tail_accepted"],
            "acceptance": acceptance,
            "train_seconds": tot["train_seconds"],
        }

    def train(self, on_epoch: Callable[[dict], None] | None = None) -> list[dict]:
        """Run ``config.epochs`` epochs; returns one record per epoch (see module README)."""
        cfg = self.config
        records = []
        steps_per_epoch = -(-len(self.examples) // cfg.prompts_per_step)
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=(cfg.epochs - self.start_epoch) * steps_per_epoch, desc=f"GRPO [{self.label}]", unit="step", leave=False
            )
        for epoch in range(self.start_epoch, cfg.epochs):
            # Shuffled every epoch: the cache is keyed by prompt ids, so order does not matter.
            order = list(range(len(self.examples)))
            random.Random(cfg.seed * _EPOCH_SEED_STRIDE + epoch).shuffle(order)
            steps = []
            for s in range(0, len(order), cfg.prompts_per_step):
                rec = self.train_step(order[s : s + cfg.prompts_per_step], epoch)
                steps.append(rec)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(epoch=epoch + 1, reward=f"{rec['mean_reward']:.3f}", gen=rec["tokens_generated"])
            record = self._epoch_record(epoch + 1, steps, self.label, cfg.lenience, cfg.acceptance)
            records.append(record)
            if cfg.save_checkpoint:
                self._save(epoch)
            if on_epoch is not None:
                on_epoch(record)
        if bar is not None:
            bar.close()
        return records
