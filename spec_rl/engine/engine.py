"""PagedEngine: batched generation over a paged KV cache, with draft splicing.

The model's own modeling code does all the math; attention is swapped for the
paged attention of :mod:`spec_rl.engine.attention` only inside engine calls.
Every forward is *packed*: one row holding the new tokens of all sequences.

Two uses:

- :meth:`PagedEngine.generate` (the :class:`~spec_rl.generation.GenerationBackend`
  protocol): prefill, then batched decode over the active sequences. Identical
  contexts (the G samples of a group) are prefilled once and forked: they share
  the prompt's blocks, and the partially filled last block is copied on write
  when they diverge (:mod:`spec_rl.engine.blocks`).
- The speculative path (SPEC-RL rule steps 1-4, DESIGN.md; issue 4 "no
  re-prefill"): :meth:`PagedEngine.score_drafts` runs ONE forward over
  [prompt, draft] per row that writes K/V into the paged cache and returns the
  per-draft-token scores; after ``verify``, :meth:`PagedEngine.continue_from`
  cuts each sequence to prompt + n (blocks past it are freed), feeds the token
  the rollout sampled from the scoring output at position prompt + n - 1, and
  decodes on. Nothing is prefilled twice (see :class:`EngineStats`).

Scheduling: a sequence is admitted only when the free blocks cover the
worst case of every running sequence (its remaining budget), so decode never
runs out of blocks mid-step; what does not fit waits until running sequences
finish and free their blocks. A single sequence that cannot fit in an empty
cache raises :class:`~spec_rl.engine.blocks.OutOfBlocks`.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from .. import ops
from ..generation import Continuation
from ..sampling import SamplingSettings, sample_tokens
from ..scoring import DraftScores, ScoringHead
from .attention import build_batch, paged_attention_active
from .blocks import BlockManager, OutOfBlocks


@dataclass
class EngineStats:
    """Token counts since construction (or :meth:`PagedEngine.reset_stats`).

    Attributes:
        prefill_tokens: tokens fed in prefill forwards (new contexts), scoring included.
        scoring_tokens: tokens fed by :meth:`PagedEngine.score_drafts` (part of prefill_tokens).
        decode_tokens: tokens fed in decode steps (one per active sequence per step).
        reprefill_tokens: tokens prefilled again because a scored sequence's K/V had to be
            evicted for lack of blocks (part of prefill_tokens; 0 when the cache is large enough).
        shared_prefill_tokens: context tokens not prefilled because a group shares them.
        cow_copies: blocks copied on write.
        forwards: model forward calls.
    """

    prefill_tokens: int = 0
    scoring_tokens: int = 0
    decode_tokens: int = 0
    reprefill_tokens: int = 0
    shared_prefill_tokens: int = 0
    cow_copies: int = 0
    forwards: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Seq:
    """One sequence being generated."""

    sid: int
    out: int  # index into the caller's result list
    budget: int  # tokens still to sample
    last: int | None = None  # sampled token whose K/V is not written yet
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    context: list[int] | None = None  # tokens in the cache (resumed sequences only; for eviction)


@dataclass
class _Fresh:
    """Contexts waiting for prefill: members share the context (a group)."""

    context: list[int]
    members: list[tuple[int, int]]  # (result index, budget)
    reprefill: bool = False


@dataclass
class SpliceHandle:
    """Scored sequences kept in the paged cache between score_drafts and continue_from.

    Attributes:
        prompts, drafts: the scored rows.
        sids: engine sequence ids (None where the row's K/V had to be evicted).
        epoch: engine epoch at scoring time (a handle is valid for one continue_from).
    """

    prompts: list[list[int]]
    drafts: list[list[int]]
    sids: list[int | None]
    epoch: int
    used: bool = False


class PagedEngine:
    """Generation backend over a paged KV cache for transformers causal LMs (Llama, Qwen2, Qwen3 families).

    Args:
        model: a transformers causal LM whose attention modules dispatch through
            ``AttentionInterface`` (all current Llama/Qwen2/Qwen3 code does).
        eos_ids: the complete EOS set (:func:`spec_rl.generation.eos_token_ids`).
        pad_id: kept for interface parity with TransformersBackend (packed input needs no padding).
        block_size: tokens per KV block (default 16).
        num_blocks: blocks in the cache; default: as many as ``kv_cache_bytes`` allows.
        kv_cache_bytes: KV memory budget in bytes when ``num_blocks`` is None
            (default 1 GiB on CPU, 40% of free memory on CUDA).
        max_batch_size: most sequences decoded together.
        max_tokens_per_forward: most tokens in one prefill/scoring forward
            (default 4096 on CPU, 32768 on GPU).
        progress: tqdm bar over decode steps.

    Raises:
        ValueError: bad sizes, empty ``eos_ids``, or a model with sliding-window layers.
    """

    def __init__(
        self,
        model,
        eos_ids,
        pad_id: int,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        max_batch_size: int = 256,
        max_tokens_per_forward: int | None = None,
        progress: bool = False,
    ):
        if not eos_ids:
            raise ValueError("eos_ids must contain at least one end-of-sequence id (see spec_rl.generation.eos_token_ids)")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        cfg = model.config
        if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
            raise ValueError("PagedEngine does not support sliding-window attention; use TransformersBackend for this model")
        self.model = model
        self.eos_ids = sorted({int(x) for x in eos_ids})
        self._eos_set = set(self.eos_ids)
        self.pad_id = int(pad_id)
        self.max_batch_size = int(max_batch_size)
        self.progress = progress
        dev = self.device
        if max_tokens_per_forward is None:
            max_tokens_per_forward = 32768 if dev.type == "cuda" else 4096
        if max_tokens_per_forward < 1:
            raise ValueError(f"max_tokens_per_forward must be >= 1, got {max_tokens_per_forward}")
        self.max_tokens_per_forward = int(max_tokens_per_forward)

        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.num_layers = int(text_cfg.num_hidden_layers)
        self.kv_heads = int(getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads)
        self.head_dim = int(getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads)
        self.dtype = next(model.parameters()).dtype
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"model dtype {self.dtype} is not supported by the paged cache (fp32/fp16/bf16)")
        bytes_per_block = self.num_layers * 2 * int(block_size) * self.kv_heads * self.head_dim * self.dtype.itemsize
        if num_blocks is None:
            if kv_cache_bytes is None:
                if dev.type == "cuda":
                    free, _ = torch.cuda.mem_get_info(dev)
                    kv_cache_bytes = int(0.4 * free)
                else:
                    kv_cache_bytes = 1 << 30
            num_blocks = max(1, int(kv_cache_bytes) // bytes_per_block)
        self.blocks = BlockManager(num_blocks, block_size)  # validates both
        self.block_size = self.blocks.block_size
        self._kv: list[torch.Tensor] | None = None  # allocated on first use
        self._ids = itertools.count()
        self._epoch = 0
        self.head = ScoringHead(model)  # decides hidden-state vs logits scoring
        self.stats = EngineStats()
        self._decode_kernel = None
        if dev.type == "cuda":
            try:
                from spec_rl import kernels

                self._decode_kernel = getattr(kernels, "paged_decode_attention", None)
            except Exception:  # pragma: no cover - triton missing
                self._decode_kernel = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reset_stats(self) -> None:
        self.stats = EngineStats()

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        contexts: Sequence[Sequence[int]],
        budgets: Sequence[int],
        settings: SamplingSettings,
        seed: int,
    ) -> list[Continuation]:
        """Sample up to ``budgets[i]`` tokens after ``contexts[i]`` (GenerationBackend protocol).

        Returns one :class:`~spec_rl.generation.Continuation` per context, in order.

        Raises:
            ValueError: mismatched lengths, an empty context or a negative budget.
            OutOfBlocks: one context plus its budget cannot fit even in an empty cache.
        """
        if len(contexts) != len(budgets):
            raise ValueError(f"contexts ({len(contexts)}) and budgets ({len(budgets)}) must have the same length")
        results: list[Continuation | None] = [None] * len(contexts)
        fresh = self._group(contexts, budgets, results, "contexts", "budgets")
        return self._run(fresh, [], results, settings, seed)

    @torch.no_grad()
    def score_drafts(self, prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]) -> tuple[DraftScores, SpliceHandle]:
        """One forward over [prompt, draft] per row; K/V stay in the paged cache.

        Same output contract as :meth:`spec_rl.scoring.PolicyScorer.score`: row i of the
        returned :class:`~spec_rl.scoring.DraftScores` scores draft token i (the output at
        position len(prompt) - 1 + i), R = max draft length (at least 1).

        Returns:
            (scores, handle): pass the handle to :meth:`continue_from` exactly once;
            no other engine call may run in between.

        Raises:
            ValueError: mismatched lengths or an empty prompt.
            OutOfBlocks: one row cannot fit even in an empty cache.
        """
        if len(prompts) != len(drafts):
            raise ValueError(f"prompts ({len(prompts)}) and drafts ({len(drafts)}) must have the same length")
        prompts = [[int(t) for t in p] for p in prompts]
        drafts = [[int(t) for t in d] for d in drafts]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompts[{i}] is empty; a prompt needs at least one token")
        self._ensure_cache()
        self._epoch += 1
        hidden = self.head.uses_hidden_states
        head = self.model.get_output_embeddings()
        bsz = len(prompts)
        max_r = max([len(d) for d in drafts] + [1])
        width = head.weight.shape[1] if hidden else head.weight.shape[0]
        out = torch.zeros((bsz, max_r, width), dtype=self.dtype if hidden else torch.float32, device=self.device)
        sids: list[int | None] = [None] * bsz
        resident: deque[int] = deque()  # rows whose K/V is in the cache, oldest first
        order = list(range(bsz))
        try:
            self._score_rows(prompts, drafts, order, sids, resident, out, hidden)
        except BaseException:
            for sid in sids:
                if sid is not None and self.blocks.has(sid):
                    self.blocks.free(sid)
            raise
        handle = SpliceHandle(prompts, drafts, sids, self._epoch)
        if hidden:
            return DraftScores(hidden_states=out, lm_head_weight=head.weight, lm_head_bias=getattr(head, "bias", None)), handle
        return DraftScores(logits=out), handle

    def _score_rows(self, prompts, drafts, order, sids, resident, out, hidden) -> None:
        bsz, start = len(order), 0
        while start < bsz:
            # Pack rows up to max_tokens_per_forward tokens.
            end, tokens = start, 0
            while end < bsz and (end == start or tokens + len(prompts[order[end]]) + len(drafts[order[end]]) <= self.max_tokens_per_forward):
                tokens += len(prompts[order[end]]) + len(drafts[order[end]])
                end += 1
            rows = order[start:end]
            need = sum(self.blocks.blocks_for(len(prompts[r]) + len(drafts[r])) for r in rows)
            while need > self.blocks.num_free and resident:
                # Evict the oldest scored rows: continue_from re-prefills them (counted in stats).
                r = resident.popleft()
                self.blocks.free(sids[r])
                sids[r] = None
            while need > self.blocks.num_free and len(rows) > 1:  # fewer rows per forward
                end = start + len(rows) // 2
                rows = order[start:end]
                need = sum(self.blocks.blocks_for(len(prompts[r]) + len(drafts[r])) for r in rows)
            if need > self.blocks.num_free:
                raise OutOfBlocks(need, self.blocks.num_free, "scoring one prompt + draft; raise num_blocks")
            tokens = sum(len(prompts[r]) + len(drafts[r]) for r in rows)
            items, want = [], []
            for r in rows:
                sid = next(self._ids)
                self.blocks.allocate(sid, 0)
                sids[r] = sid
                seq = prompts[r] + drafts[r]
                items.append((sid, seq, 0))
                plen, rlen = len(prompts[r]), max(len(drafts[r]), 1)
                # Draft token i is scored at position plen - 1 + i (clamped for an empty draft).
                want.append([min(plen - 1 + i, len(seq) - 1) for i in range(rlen)])
            values = self._forward(items, want, hidden=hidden)
            self.stats.prefill_tokens += tokens
            self.stats.scoring_tokens += tokens
            for r, v in zip(rows, values):
                out[r, : v.shape[0]] = v.to(out.dtype)
                resident.append(r)
            start = end

    def release(self, handle: SpliceHandle) -> None:
        """Free the cache blocks of a handle that will not be continued (idempotent)."""
        for sid in handle.sids:
            if sid is not None and self.blocks.has(sid):
                self.blocks.free(sid)
        handle.sids = [None] * len(handle.sids)
        handle.used = True

    def continue_from(
        self,
        handle: SpliceHandle,
        accepted_lens: Sequence[int],
        first_tokens: Sequence[int | None],
        budgets: Sequence[int],
        settings: SamplingSettings,
        seed: int,
        extra_contexts: Sequence[Sequence[int]] = (),
        extra_budgets: Sequence[int] = (),
    ) -> list[Continuation]:
        """Continue scored rows from their verified prefix, without prefilling it again.

        Row i is cut to prompt + accepted_lens[i] tokens (blocks past it freed),
        ``first_tokens[i]`` (sampled by the caller from the scoring output at
        position prompt + n - 1) is fed at position prompt + n, and up to
        ``budgets[i]`` more tokens are sampled. A row with ``first_tokens[i]`` None
        or ``budgets[i]`` == 0 is just released (empty "length" continuation).
        ``extra_contexts`` are generated from scratch in the same decode batches
        (as :meth:`generate`). Every sequence of the handle is freed afterwards.

        Returns:
            Continuations for the handle's rows (not including ``first_tokens``),
            then for ``extra_contexts``.

        Raises:
            ValueError: stale or reused handle, mismatched lengths, n outside [0, len(draft)].
        """
        if not isinstance(handle, SpliceHandle):
            raise TypeError(f"handle must come from score_drafts, got {type(handle).__name__}")
        if handle.used or handle.epoch != self._epoch:
            self.release(handle)
            raise ValueError("handle is stale: call continue_from once, right after the score_drafts that made it")
        rows = len(handle.sids)
        for name, seq in (("accepted_lens", accepted_lens), ("first_tokens", first_tokens), ("budgets", budgets)):
            if len(seq) != rows:
                raise ValueError(f"{name} has {len(seq)} entries; the handle has {rows} rows")
        if len(extra_contexts) != len(extra_budgets):
            raise ValueError(f"extra_contexts ({len(extra_contexts)}) and extra_budgets ({len(extra_budgets)}) differ in length")
        handle.used = True
        results: list[Continuation | None] = [None] * (rows + len(extra_contexts))
        resumed: list[_Seq] = []
        fresh: list[_Fresh] = []
        try:
            for i in range(rows):
                n, tok, budget, sid = int(accepted_lens[i]), first_tokens[i], int(budgets[i]), handle.sids[i]
                if not 0 <= n <= len(handle.drafts[i]):
                    raise ValueError(f"accepted_lens[{i}] = {n} is outside [0, {len(handle.drafts[i])}] (the draft length)")
                if budget < 0:
                    raise ValueError(f"budgets[{i}] = {budget} is negative")
                if tok is None or budget == 0:
                    results[i] = Continuation([], [], "length")
                    continue
                if sid is None:  # evicted while scoring: prefill prompt + prefix + token again
                    ctx = handle.prompts[i] + handle.drafts[i][:n] + [int(tok)]
                    fresh.append(_Fresh(ctx, [(i, budget)], reprefill=True))
                    continue
                self.blocks.truncate(sid, len(handle.prompts[i]) + n)
                handle.sids[i] = None  # ownership moves to the run loop
                ctx = handle.prompts[i] + handle.drafts[i][:n]
                resumed.append(_Seq(sid=sid, out=i, budget=budget, last=int(tok), context=ctx))
        finally:
            for sid in handle.sids:
                if sid is not None:
                    self.blocks.free(sid)
            handle.sids = [None] * rows
        if extra_contexts:
            sub: list[Continuation | None] = [None] * len(extra_contexts)
            groups = self._group(extra_contexts, extra_budgets, sub, "extra_contexts", "extra_budgets")
            for k, c in enumerate(sub):
                if c is not None:
                    results[rows + k] = c
            for g in groups:
                g.members = [(rows + idx, b) for idx, b in g.members]
            fresh.extend(groups)
        return self._run(fresh, resumed, results, settings, seed)

    # --------------------------------------------------------------- scheduling
    def _group(self, contexts, budgets, results, cname, bname) -> list[_Fresh]:
        groups: dict[tuple[int, ...], _Fresh] = {}
        for i, (ctx, budget) in enumerate(zip(contexts, budgets)):
            if int(budget) != budget or budget < 0:
                raise ValueError(f"{bname}[{i}] = {budget} must be an integer >= 0")
            if len(ctx) == 0:
                raise ValueError(f"{cname}[{i}] is empty; a context needs at least one token (the prompt)")
            if budget == 0:
                results[i] = Continuation([], [], "length")
                continue
            key = tuple(int(t) for t in ctx)
            if key not in groups:
                groups[key] = _Fresh(list(key), [])
            groups[key].members.append((i, int(budget)))
        return list(groups.values())

    def _future_need(self, s: _Seq) -> int:
        """Most blocks ``s`` can still take: K/V growth of at most its remaining budget (+1 copy-on-write)."""
        return self.blocks.append_cost(s.sid, s.budget)

    def _group_need(self, g: _Fresh) -> int:
        plen = len(g.context)
        cow = 1 if plen % self.block_size and len(g.members) > 1 else 0
        need = self.blocks.blocks_for(plen)
        for _, b in g.members:
            need += self.blocks.blocks_for(plen + b - 1) - self.blocks.blocks_for(plen) + cow
        return need

    def _ensure_cache(self) -> None:
        if self._kv is None:
            shape = (self.blocks.num_blocks, 2, self.block_size, self.kv_heads, self.head_dim)
            # Unwritten slots are never read: gather_kv and the kernels stop at each sequence's length.
            self._kv = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    @torch.no_grad()
    def _run(self, fresh: list[_Fresh], resumed: list[_Seq], results, settings: SamplingSettings, seed: int):
        if not isinstance(settings, SamplingSettings):
            raise TypeError(f"settings must be a SamplingSettings, got {type(settings).__name__}")
        self._ensure_cache()
        self._epoch += 1
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed) % (1 << 63))
        waiting_fresh = deque(fresh)
        waiting_resumed = deque(resumed)
        running: list[_Seq] = []
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(desc="decode", leave=False, unit="tok")
        try:
            while waiting_fresh or waiting_resumed or running:
                committed = sum(self._future_need(s) for s in running)
                # Resumed sequences hold blocks already: admit them first.
                while waiting_resumed and len(running) < self.max_batch_size:
                    s = waiting_resumed[0]
                    need = self._future_need(s)
                    if committed + need > self.blocks.num_free:
                        break
                    committed += need
                    running.append(waiting_resumed.popleft())
                if waiting_resumed and not running:
                    # Nothing runs and the next resumed sequence does not fit: give up the
                    # K/V of a waiting one (newest first) and prefill it again later.
                    s = waiting_resumed.pop()
                    self.blocks.free(s.sid)
                    waiting_fresh.append(_Fresh(s.context + [s.last], [(s.out, s.budget)], reprefill=True))
                    continue
                admitted: list[_Fresh] = []
                while waiting_fresh and len(running) + sum(len(g.members) for g in admitted) + len(waiting_fresh[0].members) <= self.max_batch_size:
                    g = waiting_fresh[0]
                    need = self._group_need(g)
                    if committed + need <= self.blocks.num_free:
                        committed += need
                        admitted.append(waiting_fresh.popleft())
                        continue
                    if running or admitted or waiting_resumed:
                        break
                    if len(g.members) > 1:  # a whole group does not fit an idle cache: split it
                        waiting_fresh.popleft()
                        for m in reversed(g.members):
                            waiting_fresh.appendleft(_Fresh(list(g.context), [m], g.reprefill))
                        continue
                    raise OutOfBlocks(need, self.blocks.num_free, f"a context of {len(g.context)} tokens with budget {g.members[0][1]}")
                if not admitted and waiting_fresh and not running and not waiting_resumed:
                    # max_batch_size smaller than one group: split it.
                    g = waiting_fresh.popleft()
                    for m in reversed(g.members):
                        waiting_fresh.appendleft(_Fresh(list(g.context), [m], g.reprefill))
                    continue
                if admitted:
                    running.extend(self._prefill(admitted, settings, gen, results))
                step = [s for s in running if s.finish is None]
                if step:
                    self._decode(step, settings, gen)
                    if bar is not None:
                        bar.update(len(step))
                still = []
                for s in running:
                    if s.finish is None:
                        still.append(s)
                    else:
                        self.blocks.free(s.sid)
                        results[s.out] = Continuation(s.tokens, s.logprobs, s.finish)
                running = still
        except BaseException:
            for s in itertools.chain(running, waiting_resumed):
                if self.blocks.has(s.sid):
                    self.blocks.free(s.sid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return results

    def _prefill(self, groups: list[_Fresh], settings, gen, results) -> list[_Seq]:
        """Prefill each group's context once, fork its members, sample their first tokens."""
        new: list[_Seq] = []
        pos = 0
        while pos < len(groups):
            chunk, tokens = [], 0
            while pos < len(groups) and (not chunk or tokens + len(groups[pos].context) <= self.max_tokens_per_forward):
                chunk.append(groups[pos])
                tokens += len(groups[pos].context)
                pos += 1
            items = []
            for g in chunk:
                sid = next(self._ids)
                self.blocks.allocate(sid, 0)
                items.append((sid, g.context, 0))
            logits = self._forward(items, [[len(g.context) - 1] for g in chunk], hidden=False)
            self.stats.prefill_tokens += tokens
            self.stats.reprefill_tokens += sum(len(g.context) for g in chunk if g.reprefill)
            rows, seqs = [], []
            for k, (g, (root, _, _)) in enumerate(zip(chunk, items)):
                for m, (out, budget) in enumerate(g.members):
                    sid = root
                    if m > 0:
                        sid = next(self._ids)
                        self.blocks.fork(root, sid)
                        self.stats.shared_prefill_tokens += len(g.context)
                    seqs.append(_Seq(sid=sid, out=out, budget=budget))
                    rows.append(k)
            lg = torch.cat([l for l in logits], 0)[torch.tensor(rows, device=self.device)]
            self._sample(seqs, lg, settings, gen)
            new.extend(seqs)
        return new

    def _decode(self, seqs: list[_Seq], settings, gen) -> None:
        items = [(s.sid, [s.last], self.blocks.length(s.sid)) for s in seqs]
        logits = self._forward(items, [[0] for _ in seqs], hidden=False, relative=True)
        self.stats.decode_tokens += len(seqs)
        self._sample(seqs, torch.cat(logits, 0), settings, gen)

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor, settings, gen) -> None:
        ids, lps = sample_tokens(logits.float(), settings, gen)
        for s, t, lp in zip(seqs, ids.tolist(), lps.tolist()):
            s.tokens.append(t)
            s.logprobs.append(lp)
            s.budget -= 1
            s.last = t
            if t in self._eos_set:
                s.finish = "eos"
            elif s.budget <= 0:
                s.finish = "length"

    # ------------------------------------------------------------------ forward
    def _forward(self, items, want, hidden: bool, relative: bool = False) -> list[torch.Tensor]:
        """One packed forward.

        Args:
            items: (sid, new token ids, start position) per sequence; the sequence must hold
                exactly ``start`` tokens; slots for the new tokens are appended here.
            want: per item, positions whose output to return (absolute, or relative to the
                item's first new token when ``relative``).
            hidden: return final hidden states instead of logits.

        Returns:
            per item a [len(want[i]), V or d] tensor.
        """
        cost = sum(self.blocks.append_cost(sid, len(toks)) for sid, toks, _ in items)
        if cost > self.blocks.num_free:
            raise OutOfBlocks(cost, self.blocks.num_free, "forward")
        slots, cow, tables, starts, q_lens, ids, pos, keep = [], [], [], [], [], [], [], []
        offset = 0
        for (sid, toks, start), w in zip(items, want):
            if self.blocks.length(sid) != start:
                raise RuntimeError(f"engine bug: sequence {sid} holds {self.blocks.length(sid)} tokens, expected {start}")
            new_slots, pairs = self.blocks.append_slots(sid, len(toks))
            slots.extend(new_slots)
            cow.extend(pairs)
            tables.append(self.blocks.block_table(sid))
            starts.append(start)
            q_lens.append(len(toks))
            ids.extend(toks)
            pos.extend(range(start, start + len(toks)))
            base = offset if relative else offset - start
            keep.extend(base + p for p in w)
            offset += len(toks)
        dev = self.device
        if cow:
            mapping = torch.tensor(cow, dtype=torch.long, device=dev)
            for layer in self._kv:
                ops.copy_blocks(layer, mapping)
            self.stats.cow_copies += len(cow)
        batch = build_batch(self._kv, slots, tables, starts, q_lens, dev, self._decode_kernel)
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        position_ids = torch.tensor([pos], dtype=torch.long, device=dev)
        keep_t = torch.tensor(keep, dtype=torch.long, device=dev)
        self.stats.forwards += 1
        with paged_attention_active(self.model, batch):
            if hidden:
                h = self.head.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
                values = h[0, keep_t]
            else:
                values = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep_t).logits[0]
        sizes = [len(w) for w in want]
        return list(values.split(sizes, 0))
