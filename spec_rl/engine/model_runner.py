"""Model runner of the paged engine: the KV cache tensors, the packed forward, prefill, decode steps.

Every forward is *packed*: one row [1, T] holding the new tokens of all
sequences, with explicit position ids. The model's own modeling code does the
math; attention is swapped for :mod:`spec_rl.engine.attention` only inside a
forward, which writes the new K/V through the slot mapping and attends over
each sequence's blocks (docs/design.md "Paged KV cache").
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch

from .. import ops
from ..acceptance.scores import response_positions
from ..backends.protocol import BackendStats
from ..backends.scoring import ScoringHead
from ..util.model_config import model_may_slide
from ..util.validation import check_int
from .attention import build_batch, paged_attention_active
from .blocks import BlockManager, OutOfBlocks
from .sampler import KeyedSampler
from .sequence import PrefillGroup, SequenceState

DEFAULT_CPU_KV_BYTES = 1 << 30  # KV budget on CPU when neither num_blocks nor kv_cache_bytes is given
CUDA_FREE_MEMORY_SHARE = 0.4  # share of free CUDA memory the KV cache takes by default


@dataclass
class EngineStats(BackendStats):
    """Counters since the engine was built (or :meth:`PagedEngine.reset_stats`).

    Attributes:
        prefill_tokens: tokens fed in prefill forwards (new contexts), scoring included.
        reprefill_tokens: tokens prefilled again because a scored sequence's K/V had to be
            evicted for lack of blocks (part of prefill_tokens; 0 when the cache is large enough).
        decode_steps: forwards run by generate/continue_from (prefill waves and decode steps;
            the scoring pass is not counted).
        proposed_tokens: history tokens proposed in decode steps (speculation past the cut).
        accepted_tokens: proposed tokens that equalled the policy's sample and were kept.
        scoring_tokens: tokens fed by :meth:`PagedEngine.score_drafts` (part of prefill_tokens).
        decode_tokens: tokens fed in decode steps (per active sequence and step: its pending
            token and its proposed tokens).
        shared_prefill_tokens: context tokens not prefilled because a group shares them.
        cow_copies: blocks copied on write.
        forwards: model forward calls, scoring included.
    """

    scoring_tokens: int = 0
    decode_tokens: int = 0
    shared_prefill_tokens: int = 0
    cow_copies: int = 0
    forwards: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CacheLayout:
    """Shape of one model's paged KV cache: one [num_blocks, 2, block_size, kv_heads, head_dim] tensor per layer."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model(cls, model) -> CacheLayout:
        """Read the layout from a transformers config (the text config of a multimodal one).

        Raises:
            ValueError: sliding-window attention layers (the cache keeps every token), or a
                model dtype other than fp32/fp16/bf16.
        """
        cfg = model.config
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        if model_may_slide(model):
            raise ValueError("PagedEngine does not support sliding-window attention; serve this model with VLLMBackend")
        dtype = next(model.parameters()).dtype
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"model dtype {dtype} is not supported by the paged cache (fp32/fp16/bf16)")
        return cls(
            num_layers=int(text.num_hidden_layers),
            kv_heads=int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads),
            dtype=dtype,
        )

    def bytes_per_block(self, block_size: int) -> int:
        return self.num_layers * 2 * int(block_size) * self.kv_heads * self.head_dim * self.dtype.itemsize

    def num_blocks_for(self, block_size: int, device: torch.device, kv_cache_bytes: int | None = None) -> int:
        """Blocks that fit ``kv_cache_bytes`` (default: 1 GiB on CPU, 40% of free memory on CUDA).

        Raises:
            TypeError: a non-integer ``kv_cache_bytes``.
            ValueError: ``kv_cache_bytes`` < 1, or too small for one block.
        """
        cuda_share = kv_cache_bytes is None and device.type == "cuda"
        if cuda_share:
            kv_cache_bytes = int(CUDA_FREE_MEMORY_SHARE * torch.cuda.mem_get_info(device)[0])
        elif kv_cache_bytes is None:
            kv_cache_bytes = DEFAULT_CPU_KV_BYTES
        kv_cache_bytes = check_int("kv_cache_bytes", kv_cache_bytes, low=1)
        per_block = self.bytes_per_block(block_size)
        if kv_cache_bytes < per_block:
            what = f"{CUDA_FREE_MEMORY_SHARE:.0%} of free CUDA memory" if cuda_share else "kv_cache_bytes"
            raise ValueError(
                f"{what}={kv_cache_bytes} holds no KV block ({per_block} bytes at block_size={block_size}); "
                "raise kv_cache_bytes or pass num_blocks"
            )
        return kv_cache_bytes // per_block


def find_decode_kernel(device: torch.device):
    """``spec_rl.kernels.paged_decode_attention`` on CUDA when Triton is available, else None."""
    if device.type != "cuda":
        return None
    try:
        from spec_rl import kernels
    except Exception:  # pragma: no cover - triton missing
        return None
    return getattr(kernels, "paged_decode_attention", None)


class ModelRunner:
    """Runs packed forwards of one model over the paged KV cache: prefill and decode steps.

    Parameters
    ----------
    model:
        a transformers causal LM whose attention dispatches through ``AttentionInterface``.
    head:
        its :class:`~spec_rl.backends.scoring.ScoringHead` (hidden-state or logits outputs).
    blocks:
        the engine's block manager; the runner appends slots and applies copy-on-write.
    layout:
        the cache layout (:class:`CacheLayout`).

    Attributes
    ----------
    kv_caches:
        one [num_blocks, 2, block_size, kv_heads, head_dim] tensor per layer (None until first use).
    decode_kernel:
        the attention kernel for one-query-per-sequence batches on CUDA, or None (gather + SDPA).
    stats:
        the :class:`EngineStats` the runner counts into.
    """

    def __init__(self, model, head: ScoringHead, blocks: BlockManager, layout: CacheLayout):
        self.model = model
        self.head = head
        self.blocks = blocks
        self.layout = layout
        self.kv_caches: list[torch.Tensor] | None = None
        self.decode_kernel = find_decode_kernel(self.device)
        self.stats = EngineStats()
        self._seq_ids = itertools.count()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def allocate_cache(self) -> None:
        """Allocate the KV tensors on first use."""
        if self.kv_caches is None:
            lay = self.layout
            shape = (self.blocks.num_blocks, 2, self.blocks.block_size, lay.kv_heads, lay.head_dim)
            # Unwritten slots are never read: gather_kv and the kernels stop at each sequence's length.
            self.kv_caches = [torch.empty(shape, dtype=lay.dtype, device=self.device) for _ in range(lay.num_layers)]

    def new_sequence(self) -> int:
        """A fresh, empty sequence in the block manager; returns its id."""
        seq_id = next(self._seq_ids)
        self.blocks.allocate(seq_id, 0)
        return seq_id

    def fork_sequence(self, parent: int, length: int | None = None) -> int:
        """A new sequence sharing ``parent``'s first ``length`` tokens (default: all); returns its id."""
        seq_id = next(self._seq_ids)
        self.blocks.fork(parent, seq_id, length)
        return seq_id

    # ------------------------------------------------------------------ forward
    def forward(self, items, want, hidden: bool, relative: bool = False) -> list[torch.Tensor]:
        """One packed forward.

        Parameters
        ----------
        items:
            (seq_id, new token ids, start position) per sequence; the sequence must hold
            exactly ``start`` tokens; slots for the new tokens are appended here.
        want:
            per item, positions whose output to return (absolute, or relative to the
            item's first new token when ``relative``).
        hidden:
            return final hidden states [.., d] instead of logits [.., V].

        Returns
        -------
        list[torch.Tensor]
            per item a [len(want[i]), V or d] tensor.

        Raises
        ------
        OutOfBlocks
            the new tokens need more blocks than are free (nothing changed).
        """
        cost = sum(self.blocks.append_cost(seq_id, len(toks)) for seq_id, toks, _ in items)
        if cost > self.blocks.num_free:
            raise OutOfBlocks(cost, self.blocks.num_free, "forward")
        slots, cow, tables, starts, q_lens, ids, pos, keep = [], [], [], [], [], [], [], []
        offset = 0
        for (seq_id, toks, start), w in zip(items, want):
            if self.blocks.length(seq_id) != start:
                held = self.blocks.length(seq_id)
                raise RuntimeError(f"engine bug: sequence {seq_id} holds {held} tokens, expected {start}")
            new_slots, pairs = self.blocks.append_slots(seq_id, len(toks))
            slots.extend(new_slots)
            cow.extend(pairs)
            tables.append(self.blocks.block_table(seq_id))
            starts.append(start)
            q_lens.append(len(toks))
            ids.extend(toks)
            pos.extend(range(start, start + len(toks)))
            base = offset if relative else offset - start
            keep.extend(base + p for p in w)
            offset += len(toks)
        self._copy_on_write(cow)
        dev = self.device
        batch = build_batch(self.kv_caches, slots, tables, starts, q_lens, dev, self.decode_kernel)
        inputs = dict(
            input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
            position_ids=torch.tensor([pos], dtype=torch.long, device=dev),
            use_cache=False,
        )
        keep_t = torch.tensor(keep, dtype=torch.long, device=dev)
        self.stats.forwards += 1
        with paged_attention_active(self.model, batch):
            if hidden:
                values = self.head.states(hidden=True, **inputs)[0, keep_t]
            else:
                values = self.head.states(hidden=False, logits_to_keep=keep_t, **inputs)[0]
        return list(values.split([len(w) for w in want], 0))

    def _copy_on_write(self, pairs: list[tuple[int, int]]) -> None:
        """Copy shared blocks (src, dst) in every layer before the forward writes into them."""
        if pairs:
            mapping = torch.tensor(pairs, dtype=torch.long, device=self.device)
            for layer in self.kv_caches:
                ops.copy_blocks(layer, mapping)
            self.stats.cow_copies += len(pairs)

    # ------------------------------------------------------- prefill / decode
    def prefill(self, groups: list[PrefillGroup], sampler: KeyedSampler) -> list[SequenceState]:
        """One forward over the contexts of ``groups``; fork each group's members and sample their first tokens.

        Member m of a group draws its first token at position ``len(context)`` with its own uid,
        so the G members of a group diverge although they share the context's blocks. On an
        error every sequence made here is freed before it propagates (none is running yet).
        """
        made: list[int] = []
        try:
            return self._prefill(groups, sampler, made)
        except BaseException:
            for seq_id in made:
                if self.blocks.has(seq_id):
                    self.blocks.free(seq_id)
            raise

    def _prefill(self, groups: list[PrefillGroup], sampler: KeyedSampler, made: list[int]) -> list[SequenceState]:
        for _ in groups:
            made.append(self.new_sequence())
        roots = list(made)
        items = [(root, g.context, 0) for root, g in zip(roots, groups)]
        logits = self.forward(items, [[len(g.context) - 1] for g in groups], hidden=False)
        self.stats.prefill_tokens += sum(len(g.context) for g in groups)
        self.stats.reprefill_tokens += sum(len(g.context) for g in groups if g.reprefill)
        self.stats.decode_steps += 1
        rows, seqs, positions = [], [], []
        for k, (g, root) in enumerate(zip(groups, roots)):
            for m, member in enumerate(g.members):
                seq_id = root
                if m > 0:
                    seq_id = self.fork_sequence(root)
                    made.append(seq_id)
                    self.stats.shared_prefill_tokens += len(g.context)
                seqs.append(SequenceState(seq_id, member.result_index, member.budget))
                rows.append(k)
                positions.append(len(g.context))
        ids, lps = sampler.sample(seqs, torch.cat(logits, 0)[torch.tensor(rows, device=self.device)], positions)
        for seq, token, lp in zip(seqs, ids, lps):
            sampler.record(seq, [], [token], [lp])
        return seqs

    def decode(self, seqs: list[SequenceState], sampler: KeyedSampler) -> None:
        """One decode step: feed each sequence's pending token and its proposal, keep what is accepted.

        A sequence with proposal p (maybe empty) feeds [pending] + p in one forward; the sample
        after fed token j sits at position ``start + 1 + j`` (``start`` = tokens cached before the
        step). The accepted proposals and the sample after them are kept
        (:meth:`KeyedSampler.record`), and the K/V slots of rejected proposals are given back at
        once (:meth:`BlockManager.truncate`): the sequence then holds exactly the K/V of the tokens
        before its new pending token, as if it had been decoded one token per step.

        Attention: a step in which no sequence has a proposal feeds one query per sequence and
        uses the one-query decode kernel on CUDA (when available). A step with proposals has
        several queries per sequence and takes the prefill attention path (gather + SDPA with a
        causal mask) on every device: the Triton decode kernel only takes one query per sequence.
        """
        starts = [self.blocks.length(s.seq_id) for s in seqs]
        props = sampler.proposals(seqs)
        items = [(s.seq_id, [s.pending_token] + p, start) for s, p, start in zip(seqs, props, starts)]
        logits = self.forward(items, [range(1 + len(p)) for p in props], hidden=False, relative=True)
        self.stats.decode_tokens += sum(1 + len(p) for p in props)
        self.stats.decode_positions += sum(1 + len(p) for p in props)  # packed: no padding
        self.stats.decode_rows += len(seqs)
        self.stats.decode_steps += 1
        rows = [s for s, p in zip(seqs, props) for _ in range(1 + len(p))]
        positions = [start + 1 + j for start, p in zip(starts, props) for j in range(1 + len(p))]
        ids, lps = sampler.sample(rows, torch.cat(logits, 0), positions)
        at = 0
        for seq, p, start in zip(seqs, props, starts):
            fed = 1 + len(p)
            accepted, kept = sampler.record(seq, p, ids[at : at + fed], lps[at : at + fed])
            at += fed
            if p:
                self.stats.proposed_tokens += len(p)
                self.stats.accepted_tokens += min(accepted, kept)
                self.blocks.truncate(seq.seq_id, start + kept)  # roll back the rejected proposals' K/V

    # ------------------------------------------------------------ scoring
    def score(
        self, rows: list[int], prompts: list[list[int]], drafts: list[list[int]], seq_ids: list[int | None]
    ) -> list[torch.Tensor]:
        """One forward over [prompt, draft] of each row in ``rows``; their K/V stay in the cache.

        Each row gets a new sequence, stored in ``seq_ids[row]`` before the forward
        (so the caller can free it on an error). Returns, per row, the outputs
        [max(len(draft), 1), d|V] (hidden states or logits, the head's choice) that
        score draft token i: the output at position ``len(prompt) - 1 + i``
        (:func:`spec_rl.acceptance.scores.response_positions`).
        """
        rlens = [max(len(drafts[r]), 1) for r in rows]
        positions = response_positions(torch.tensor([len(prompts[r]) for r in rows]), max(rlens))
        items = []
        for r in rows:
            seq_ids[r] = self.new_sequence()
            items.append((seq_ids[r], prompts[r] + drafts[r], 0))
        want = [positions[k, :n].tolist() for k, n in enumerate(rlens)]
        values = self.forward(items, want, hidden=self.head.uses_hidden_states)
        tokens = sum(len(prompts[r]) + len(drafts[r]) for r in rows)
        self.stats.prefill_tokens += tokens
        self.stats.scoring_tokens += tokens
        return values
