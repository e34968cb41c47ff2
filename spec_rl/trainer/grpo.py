"""A small GRPO trainer whose rollouts go through :class:`~spec_rl.rollout.speculative.SpeculativeRollout`."""

from __future__ import annotations

import copy
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..backends import Policy, build_backend
from ..backends.base import policy_tokens
from ..backends.scoring import response_logprobs
from ..drafts.cache import RolloutCache
from ..drafts.history import HistoryIndex
from ..drafts.owner import policy_owner
from ..rollout.old_policy import PolicyVersions, copy_bytes
from ..rollout.reward_split import origin_sums, response_origins
from ..rollout.speculative import RolloutRequest, RolloutResult, SpeculativeRollout
from ..util.atomic import atomic_write_text
from ..util.memory import CPU_AVAILABLE_MEMORY_SHARE, memory_budget
from ..util.model_config import text_config
from .checkpoint import CACHE_FILE, HISTORY_FILE, OPTIMIZER_FILE, commit_checkpoint, latest_checkpoint, remove_stale
from .config import GRPOConfig, resolve_device
from .correction import weight_sums
from .heldout import START, HeldoutEvaluator
from .loss import clipped_policy_loss, group_advantages, response_mask
from .records import METRICS_FILE, epoch_record, no_signal_warning
from .report import format_row
from .versions import check_version_budget, epoch_order

# Seed of the mini-batch split: seed * stride + step; a prime, so that the (seed, step) pairs of nearby runs do not
# collide.
_MINIBATCH_SEED_STRIDE = 1_000_003
#: Where a residual-draw run with ``versions_on_disk`` keeps its weight copies, in its folder.
VERSIONS_DIR = "versions"


class GRPOTrainer:
    """GRPO (group-normalised advantages, clipped loss) with speculative rollouts; docs/api.md "Trainer".

    Appends one line per step to ``out_dir/metrics.jsonl``; ``records`` holds one record per finished epoch
    (:mod:`.records`, :mod:`.heldout`), checkpointed with it. ``train_examples`` need ``prompt``, ``answer`` and a
    stable ``uid`` (e.g. ``Example``); ``reward_fn(completion_text, gold_answer) -> float``. ``eval_examples`` (none
    a training prompt; None: off) are evaluated at epoch 0 and after epochs. ``ref_model``: the frozen initial policy
    (default: a copy of ``model``), needed when ``model`` comes from a checkpoint. Set ``initial_heldout`` before
    :meth:`train` when the warm-start evaluation is known for the same weights, seed and held-out set.
    Raises ValueError for no examples, no pad/EOS token, a prompt too long, or ``max_model_len`` above the model's."""

    def __init__(
        self,
        model,
        tokenizer,
        train_examples: Sequence,
        reward_fn: Callable[[str, str], float],
        config: GRPOConfig,
        out_dir: str | os.PathLike,
        progress: bool = True,
        label: str = "run",
        eval_examples: Sequence | None = None,
        ref_model=None,
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
        self.log = print
        self.label = label

        self.eos_ids, self.pad_id = policy_tokens(model, tokenizer)
        max_model_len = config.context_limit(getattr(model.config, "max_position_embeddings", None))
        self.settings = config.sampling
        self.prompt_ids = self._encode(self.examples, max_model_len, "prompt")
        self.heldout = None
        if eval_examples is not None:
            self._encode(eval_examples, max_model_len, "held-out prompt")
            self.heldout = HeldoutEvaluator(
                eval_examples,
                tokenizer,
                self.settings,
                config.eval_samples,
                reward_fn,
                config.seed,
                max_model_len,
                prompt_format=config.prompt_format,
            )
        self.initial_heldout: dict | None = None

        self.cache = RolloutCache()
        self.cache.claim(policy_owner(tokenizer, model.config))
        self.history = HistoryIndex() if config.mode.tail else None
        # the residual draw reads the weights of the steps whose responses are drafts (a resumed run has none yet:
        # its first epoch samples fresh); their peak is checked before anything trains
        self.old_policies = None
        rule = config.mode.rule
        if rule is not None and rule.needs_old_policy:
            folder = self.out_dir / VERSIONS_DIR if config.versions_on_disk else None
            copies = check_version_budget(config, len(self.examples), copy_bytes(model), folder)
            self.old_policies = PolicyVersions(model, self.pad_id, folder, max_copies=copies)
        self.rollout = self._make_rollout(model, config, max_model_len)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.update_tokens = update_token_budget(model, self.device)
        self._set_initial_policy(model, ref_model)
        self.step = 0
        self.start_epoch = 0
        #: One record per finished epoch, saved with every checkpoint and restored by :meth:`resume`.
        self.records: list[dict] = []
        self.metrics_path = self.out_dir / METRICS_FILE

    def _make_rollout(self, model, cfg: GRPOConfig, max_model_len: int) -> SpeculativeRollout:
        """Rollouts on backend ``cfg.generation_backend`` ("auto": vLLM on CUDA if installed, else transformers)."""
        eos = sorted(self.eos_ids)
        policy = Policy(model, self.tokenizer, eos, self.pad_id, max_model_len, self.out_dir / "vllm-weights")
        backend = build_backend(cfg.generation_backend, policy)
        return SpeculativeRollout(
            backend,
            self.cache,
            self.settings,
            eos,
            max_model_len,
            mode=cfg.mode,
            seed=cfg.seed,
            history=self.history,
            old_policies=self.old_policies,
        )

    def _set_initial_policy(self, model, ref_model) -> None:
        """The frozen initial policy: the KL term's reference and the held-out diagnostics' warm start."""
        initial = None
        if self.config.kl_coef > 0 or self.heldout is not None:
            initial = copy.deepcopy(model) if ref_model is None else ref_model.to(self.device)
            initial = initial.eval().requires_grad_(False)
        self.ref_model = initial if self.config.kl_coef > 0 else None
        if self.heldout is not None:
            self.heldout.reference, self.heldout.pad_id = initial, self.pad_id

    def _encode(self, examples: Sequence, max_model_len: int, what: str) -> list[list[int]]:
        """The prompt ids of ``examples``; ValueError for one that leaves no room for a response token."""
        prompt_ids = self.config.prompt_format.encode(self.tokenizer, examples)
        for e, ids in zip(examples, prompt_ids):
            if len(ids) >= max_model_len:
                raise ValueError(
                    f"{what} {getattr(e, 'uid', '?')!r} has {len(ids)} tokens, not less than max_model_len="
                    f"{max_model_len}; filter long prompts or raise max_model_len"
                )
        return prompt_ids

    def resume(self) -> bool:
        """Restore optimizer, counters, records, rollout cache and history from the committed checkpoint. The caller
        loads the weights from that checkpoint (:func:`spec_rl.trainer.run.load_policy`). Steps after it are dropped
        from metrics.jsonl and redone; uncommitted versions and temporary files are deleted. Returns False when there is
        no checkpoint (the run starts at step 0)."""
        ckpt = latest_checkpoint(self.out_dir, log=self.log)
        remove_stale(self.out_dir, keep=ckpt)
        if ckpt is not None:
            self.step, self.start_epoch = ckpt.step, ckpt.epoch
            self.records = list(ckpt.state.get("records", []))
            opt_path, cache_path, history_path = (ckpt.path / f for f in (OPTIMIZER_FILE, CACHE_FILE, HISTORY_FILE))
            if opt_path.is_file():
                self.optimizer.load_state_dict(torch.load(opt_path, map_location=self.device, weights_only=True))
            if cache_path.is_file():
                stored = RolloutCache.load(cache_path)
                stored.claim(self.cache.owner, f"rollout cache {cache_path}")
                self.cache.update(stored)
            if self.history is not None and history_path.is_file():
                self.history.update(HistoryIndex.load(history_path))
        self._trim_metrics()
        return ckpt is not None

    def _trim_metrics(self) -> None:
        """Drop metrics lines of steps >= ``self.step`` (and torn lines), so redone steps are not listed twice."""
        if not self.metrics_path.is_file():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                if int(json.loads(line)["step"]) < self.step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by the kill
        atomic_write_text(self.metrics_path, "".join(kept))

    def _save(self, epoch: int) -> None:
        """Commit model, optimizer, cache, history and trainer state as one checkpoint version."""

        def write_files(folder) -> None:
            self.model.save_pretrained(folder)
            self.tokenizer.save_pretrained(folder)
            torch.save(self.optimizer.state_dict(), folder / OPTIMIZER_FILE)
            self.cache.save(folder / CACHE_FILE)
            if self.history is not None:
                self.history.save(folder / HISTORY_FILE)

        state = {"epoch": epoch + 1, "step": self.step, "config": self.config.to_dict(), "records": self.records}
        commit_checkpoint(self.out_dir, state, write_files)

    def _update(self, result: RolloutResult, advantages: torch.Tensor) -> dict[str, float]:
        cfg = self.config
        self.model.train()
        masks = response_mask(result.response_ids, self.eos_ids)
        padded = result.padded(self.pad_id)
        log_ratio = padded["logprobs"] - padded["behaviour_logprobs"]  # 0 on generated tokens
        weight_record = weight_sums(log_ratio, masks, cfg.rollout_correction)
        weights = None
        if cfg.rollout_correction is not None:  # mis: masked tokens leave the loss and its token count
            weights, masks = cfg.rollout_correction.weights(log_ratio, masks)
        order = list(range(len(result.response_ids)))
        random.Random(cfg.seed * _MINIBATCH_SEED_STRIDE + self.step).shuffle(order)
        minis = [order[i :: cfg.ppo_mini_batches] for i in range(cfg.ppo_mini_batches)]
        losses, clip_fracs = [], []
        for mini in minis:
            num_tokens = int(masks[mini].sum())
            if cfg.kl_coef == 0:
                # Zero-advantage samples add no gradient; they still count in the token mean.
                mini = [i for i in mini if float(advantages[i]) != 0.0]
            if not mini or num_tokens == 0:
                continue
            self.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            lengths = [len(result.prompt_ids[i]) + len(result.response_ids[i]) for i in mini]
            for idx in micro_batches(mini, lengths, cfg.micro_batch_size, self.update_tokens):
                prompts = [result.prompt_ids[i] for i in idx]
                resps = [result.response_ids[i] for i in idx]
                lp = response_logprobs(self.model, prompts, resps, self.pad_id, self.settings)
                width = lp.shape[1]
                mask = masks[idx][:, :width].to(self.device)
                old = padded["logprobs"][idx][:, :width].to(self.device)
                w = weights[idx][:, :width].to(self.device) if weights is not None else None
                ref = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref = response_logprobs(self.ref_model, prompts, resps, self.pad_id, self.settings)
                adv = advantages[idx].to(self.device)
                loss, m = clipped_policy_loss(
                    lp, old, adv, mask, cfg.clip_low, cfg.clip_high, ref, cfg.kl_coef, num_tokens, w
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
            **weight_record,
        }

    def train_step(self, batch_indices: Sequence[int], epoch: int) -> dict:
        """One rollout, reward and policy update over the given example indices; returns the step record."""
        cfg = self.config
        requests = [
            RolloutRequest(self.prompt_ids[i], slot, dataset_id=self.examples[i].uid)
            for i in batch_indices
            for slot in range(cfg.group_size)
        ]
        self.model.eval()
        result = self.rollout.run(requests, self.step)
        if self.old_policies is not None:
            if epoch + 1 < cfg.epochs:  # this step's responses are drafts under the weights used now
                self.old_policies.keep(self.step)
            self.old_policies.retain({d.version for d in self.cache.drafts()})
        texts = self.tokenizer.batch_decode(result.response_ids, skip_special_tokens=True)
        golds = [self.examples[i].answer for i in batch_indices for _ in range(cfg.group_size)]
        rewards = torch.tensor([float(self.reward_fn(t, g)) for t, g in zip(texts, golds)])
        advantages = group_advantages(rewards, cfg.group_size, cfg.scale_adv_by_std)
        spread = rewards.reshape(-1, cfg.group_size)
        t0 = time.perf_counter()
        upd = self._update(result, advantages)
        self.rollout.backend.sync_weights()  # an engine with its own copy of the weights (vLLM) reloads them
        train_seconds = time.perf_counter() - t0
        record = {
            **cfg.mode.to_dict(),
            "mode": self.label,
            "epoch": epoch,
            "step": self.step,
            "mean_reward": float(rewards.mean()),
            "reward_sum": float(rewards.sum()),
            "groups": spread.shape[0],
            # groups whose rewards are all equal: zero advantage, no learning signal
            "flat_groups": int((spread.amax(1) == spread.amin(1)).sum()),
            **origin_sums(response_origins(result), rewards.tolist()),
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

    def _epoch_end(self, epoch: int, steps: list[dict]) -> dict:
        """The record of finished (0-based) ``epoch``, with the held-out evaluation after it."""
        cfg = self.config
        record = epoch_record(epoch + 1, steps, self.label, cfg.mode)
        if record["no_signal"]:
            self.log(no_signal_warning(self.label, record))
        if self.heldout is not None:
            if (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs:
                record.update(self.heldout.evaluate(self.model, epoch + 1))
            if epoch == 0:  # epoch 1 carries the warm-start evaluation (:meth:`train`)
                record.update({START + k: v for k, v in self.initial_heldout.items()})
        return record

    def train(self, on_epoch: Callable[[dict], None] | None = None) -> list[dict]:
        """Train epochs ``start_epoch + 1 .. config.epochs``; returns ``records`` (restored ones included). Every epoch
        ends with its evaluation (held-out examples), a committed checkpoint (``config.save_checkpoint``), then
        ``on_epoch(record)``."""
        from tqdm.auto import tqdm

        cfg = self.config
        total = (cfg.epochs - self.start_epoch) * -(-len(self.examples) // cfg.prompts_per_step)
        bar = tqdm(total=total, desc=f"GRPO [{self.label}]", unit="step", leave=False, disable=not self.progress)
        if self.heldout is not None and self.start_epoch == 0:  # the warm start (unless given), shown as epoch 0
            if self.initial_heldout is None:
                self.initial_heldout = self.heldout.evaluate(self.model, 0)
            self.log(format_row(self.label, {"epoch": 0, **self.initial_heldout}))
        for epoch in range(self.start_epoch, cfg.epochs):
            order = epoch_order(len(self.examples), cfg.seed, epoch)
            steps = []
            for s in range(0, len(order), cfg.prompts_per_step):
                rec = self.train_step(order[s : s + cfg.prompts_per_step], epoch)
                steps.append(rec)
                bar.update(1)
                bar.set_postfix(epoch=epoch + 1, reward=f"{rec['mean_reward']:.3f}", gen=rec["tokens_generated"])
            record = self._epoch_end(epoch, steps)
            self.records.append(record)
            if cfg.save_checkpoint:
                self._save(epoch)
            if on_epoch is not None:
                on_epoch(record)
        bar.close()
        return list(self.records)


def update_token_budget(model, device: torch.device) -> int:
    """Tokens (rows x padded length) one micro-batch of the update may hold, so that the whole update (gradients and
    AdamW's two moments: 3 x the trained parameters' bytes, plus one micro-batch's activations) stays within 40% of
    the free CUDA memory or an eighth of the memory available on a CPU. Activations are estimated at
    ``dtype bytes x (3 V + 28 L H)`` per token (the logits, their log-softmax and gradient; about 28 hidden-size
    tensors kept per layer: 2.5 MB a token for SmolLM2-135M in float32, measured 2.9 GB for a 1,174-token row)."""
    config = text_config(model)
    vocab, layers, hidden = (int(getattr(config, k)) for k in ("vocab_size", "num_hidden_layers", "hidden_size"))
    per_token = next(model.parameters()).element_size() * (3 * vocab + 28 * layers * hidden)
    state = 3 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return max(1, (memory_budget(device, cpu_share=CPU_AVAILABLE_MEMORY_SHARE) - state) // per_token)


def micro_batches(rows: list[int], lengths: list[int], max_rows: int, max_tokens: int) -> list[list[int]]:
    """``rows`` in order, cut into micro-batches of at most ``max_rows`` rows whose padded tokens (rows x the longest
    ``lengths``) stay within ``max_tokens`` (at least one row each): gradient accumulation makes any cut the same
    update up to float summation order."""
    out, current, longest = [], [], 0
    for row, length in zip(rows, lengths):
        longest_with = max(longest, length)
        if current and (len(current) == max_rows or (len(current) + 1) * longest_with > max_tokens):
            out.append(current)
            current, longest_with = [], length
        current.append(row)
        longest = longest_with
    return out + ([current] if current else [])
