"""Model runner of the paged engine: the KV cache tensors, and packed forwards (one row [1, T] of all new tokens with
explicit positions) whose attention is :mod:`spec_rl.backends.paged.attention` only inside the forward."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch

from ... import ops
from ...acceptance.scores import response_positions
from ...util.memory import memory_budget
from ...util.model_config import model_may_slide, text_config
from ...util.triton import kernels_for
from ..base import BackendStats
from ..scoring import ScoringHead
from .attention import build_batch, paged_attention_active
from .blocks import BlockManager
from .sampler import KeyedSampler
from .sequence import PrefillGroup, SequenceState


@dataclass
class EngineStats(BackendStats):
    """:class:`~spec_rl.backends.base.BackendStats` plus scoring, decode, shared-prefill tokens, copy-on-write
    blocks, forwards, decode steps run by a CUDA graph, the seconds spent capturing graphs (their warm-up included:
    a timing excludes them by subtracting) and the buckets whose capture failed (their steps ran eagerly);
    ``prefill_tokens`` includes scoring and re-prefills."""

    scoring_tokens: int = 0
    decode_tokens: int = 0
    shared_prefill_tokens: int = 0
    cow_copies: int = 0
    forwards: int = 0
    graph_steps: int = 0
    capture_seconds: float = 0.0
    graph_fallbacks: int = 0

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
    def of(cls, model) -> CacheLayout:
        """The K/V shape of any transformers decoder, in its own dtype (no check: a size, not a paged cache)."""
        text = text_config(model)
        return cls(
            num_layers=int(text.num_hidden_layers),
            kv_heads=int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads),
            dtype=next(model.parameters()).dtype,
        )

    @classmethod
    def from_model(cls, model) -> CacheLayout:
        """The layout of a transformers model; ValueError for sliding-window layers or a dtype not fp32/fp16/bf16."""
        text = text_config(model)
        if model_may_slide(model) or getattr(text, "attn_logit_softcapping", None):
            raise ValueError(
                "PagedEngine does not support sliding-window attention or logit soft-capping; use --backend "
                "transformers (TransformersBackend honours the window) or VLLMBackend"
            )
        layout = cls.of(model)
        if layout.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"model dtype {layout.dtype} is not supported by the paged cache (fp32/fp16/bf16)")
        return layout

    def bytes_per_block(self, block_size: int) -> int:
        return self.num_layers * 2 * int(block_size) * self.kv_heads * self.head_dim * self.dtype.itemsize

    def num_blocks_for(self, block_size: int, device: torch.device, kv_cache_bytes: int | None = None) -> int:
        """Blocks that fit ``kv_cache_bytes`` (default 1 GiB on CPU, 40% of free CUDA memory); ValueError below one."""
        if kv_cache_bytes is None and device.type != "cuda":  # the engine's CPU default: 1 GiB
            kv_cache_bytes = 1 << 30
        budget = memory_budget(device, kv_cache_bytes)
        per_block = self.bytes_per_block(block_size)
        if budget < per_block:
            raise ValueError(
                f"kv_cache_bytes={budget} holds no KV block ({per_block} bytes at block_size={block_size}); "
                "raise kv_cache_bytes or pass num_blocks"
            )
        return budget // per_block


def find_decode_kernel(device: torch.device):
    """``spec_rl.kernels.paged_decode_attention`` on CUDA when Triton is available, else None."""
    kernels = kernels_for(device) if device.type == "cuda" else None
    return None if kernels is None else kernels.paged_decode_attention


class ModelRunner:
    """Packed forwards of one model over the paged KV cache; ``kv_caches``: a tensor per layer, None until used."""

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

    @property
    def scratch_block(self) -> int:
        """The cache's last block, outside the block manager: where finished and padding rows of a static decode
        step write and read."""
        return self.blocks.num_blocks

    def allocate_cache(self) -> None:
        if self.kv_caches is None:
            lay = self.layout
            shape = (self.blocks.num_blocks + 1, 2, self.blocks.block_size, lay.kv_heads, lay.head_dim)
            # Unwritten slots are never read: gather_kv and the kernels stop at each sequence's length.
            self.kv_caches = [torch.empty(shape, dtype=lay.dtype, device=self.device) for _ in range(lay.num_layers)]
            for layer in self.kv_caches:
                layer[self.scratch_block].zero_()

    def new_sequence(self) -> int:
        seq_id = next(self._seq_ids)
        self.blocks.allocate(seq_id, 0)
        return seq_id

    def fork_sequence(self, parent: int, length: int | None = None) -> int:
        """A new sequence sharing ``parent``'s first ``length`` tokens (default: all); returns its id."""
        seq_id = next(self._seq_ids)
        self.blocks.fork(parent, seq_id, length)
        return seq_id

    def forward(self, items, want, hidden: bool, relative: bool = False) -> list[torch.Tensor]:
        """One packed forward of ``items`` (seq_id, new ids, start = tokens held): per item, outputs [len(w), d|V] at
        ``want`` positions (absolute, or ``relative`` to the first new token). The scheduler reserved the blocks."""
        cost = sum(self.blocks.append_cost(seq_id, len(toks)) for seq_id, toks, _ in items)
        assert cost <= self.blocks.num_free, (cost, self.blocks.num_free)
        slots, cow, tables, starts, q_lens, ids, pos, keep = [], [], [], [], [], [], [], []
        offset = 0
        for (seq_id, toks, start), w in zip(items, want):
            assert self.blocks.length(seq_id) == start, (seq_id, self.blocks.length(seq_id), start)
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

    def prefill(self, groups: list[PrefillGroup], sampler: KeyedSampler) -> list[SequenceState]:
        """One forward over the groups' contexts; forks the members and samples each first token with its own uid. On
        an error frees every sequence it made."""
        roots = [self.new_sequence() for _ in groups]
        made = list(roots)
        try:
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
                    seqs.append(SequenceState(seq_id, member.result_index, budget=member.budget))
                    rows.append(k)
                    positions.append(len(g.context))
            ids, lps = sampler.sample(seqs, torch.cat(logits, 0)[torch.tensor(rows, device=self.device)], positions)
            for seq, token, lp in zip(seqs, ids, lps):
                sampler.record(seq, [], [token], [lp])
            return seqs
        except BaseException:
            for seq_id in made:
                if self.blocks.has(seq_id):
                    self.blocks.free(seq_id)
            raise

    def decode(self, seqs: list[SequenceState], sampler: KeyedSampler) -> None:
        """One decode step: feed [pending] + proposal, keep what :meth:`KeyedSampler.record` accepts, free the rejected
        slots. Only steps without proposals use the CUDA decode kernel."""
        starts = [self.blocks.length(s.seq_id) for s in seqs]
        props = [sampler.proposal(s) for s in seqs]
        items = [(s.seq_id, [s.last] + p, start) for s, p, start in zip(seqs, props, starts)]
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
                self.blocks.truncate(seq.seq_id, start + kept)

    def score(
        self, rows: list[int], prompts: list[list[int]], drafts: list[list[int]], seq_ids: list[int | None]
    ) -> list[torch.Tensor]:
        """One forward over [prompt, draft] of each of ``rows``, kept as new ``seq_ids[row]`` (set before the forward);
        per row the outputs [max(len(draft), 1), d|V]."""
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
