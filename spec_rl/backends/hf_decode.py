"""Decoding over a transformers KV cache: keyed sampling, history-drafted tokens kept iff they equal the keyed sample
(lossless; docs/design.md "Tail speculation"), rollback by masking the rejected columns."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..sampling.distribution import SamplingSettings, check_seed, keyed_sample
from ..util.model_config import model_sliding_window, text_config
from .base import BackendStats, Decoding
from .decode_attention import decode_attention
from .kv_buffer import InPlaceLayer, drain, in_place_cache


def cache_argument(model) -> str:
    """The forward's KV-cache argument: ``cache`` from transformers 5.24 on, else ``past_key_values``."""
    return _cache_argument_of(type(model))


@functools.cache
def _cache_argument_of(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def returned_cache(model, out):
    """The KV cache a forward of ``model`` returned (under either name)."""
    return getattr(out, cache_argument(model), None) or getattr(out, "past_key_values", None)


def model_mask(model, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as ``model`` takes it: itself (SDPA), or additive in ``dtype`` (eager attention)."""
    if getattr(model.config, "_attn_implementation", "sdpa") != "eager":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def padded_ids(seqs: Sequence[Sequence[int]], pad_id: int, device, left: bool = False) -> tuple[torch.Tensor, ...]:
    """Right-padded (``left``: left-padded) input_ids [B, L] int64 and attention_mask [B, L] int64."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    for row, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[row, cols] = torch.as_tensor(list(s), dtype=torch.long)
        attn[row, cols] = 1
    return ids, attn


def position_masks(model, key_pos: torch.Tensor, query_pos: torch.Tensor):
    """The attention masks of a batch whose cached keys sit at token positions ``key_pos`` [B, K] (-1: no token) and
    whose queries at ``query_pos`` [B, Q]: causal in token positions, and within the sliding window on the layers that
    slide (a key at q - window or before is hidden, as transformers does). A 4-D [B, 1, Q, K] mask, or a dict by
    layer type where the config lists layer types; boolean for SDPA, additive for eager attention. Columns may hold
    left padding and rolled-back holes: the window counts tokens, not columns."""
    k, q = key_pos.unsqueeze(1), query_pos.unsqueeze(2)
    full = ((k >= 0) & (k <= q)).unsqueeze(1)
    window = model_sliding_window(model)
    sliding = full & (q - k < (window or 0)).unsqueeze(1)
    # A padding query (past its row's fed tokens) may have no token in its window: it sees the full context
    # instead, so that no NaN reaches the values of its (masked) column in the next layer.
    sliding |= full & ~sliding.any(-1, keepdim=True)
    dtype = next(model.parameters()).dtype
    masks = {"full_attention": model_mask(model, full, dtype), "sliding_attention": model_mask(model, sliding, dtype)}
    layer_types = getattr(text_config(model), "layer_types", None)
    if layer_types:
        return {t: masks[t] for t in set(layer_types)}
    return masks["sliding_attention" if window else "full_attention"]


def _attention_mask(model, mask: torch.Tensor, query_pos: torch.Tensor):
    """``mask`` [B, W] (1: a cached token) as the model takes it: itself, or position masks for a sliding model."""
    if model_sliding_window(model) is None:
        return mask
    key_pos = torch.where(mask.bool(), mask.cumsum(1) - 1, -1)
    return position_masks(model, key_pos, query_pos.to(mask.device))


@dataclass
class KVRows:
    """A left-padded batch in a ``DynamicCache`` and its mask [B, W] int64 (1: a real token of the row); its buffers
    hold at most ``max_columns`` columns (None: no limit), compacted when a step would pass them."""

    cache: object
    mask: torch.Tensor
    max_columns: int | None = None

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]

    def trim_front(self, min_columns: int = 8) -> None:
        """Drop the leading all-padding columns when there are at least ``min_columns``."""
        used = self.mask.any(0)
        lead = int(used.int().argmax()) if bool(used.any()) else 0
        if lead < min_columns:
            return
        for layer in self.cache.layers:
            if isinstance(layer, InPlaceLayer):
                layer.drop_front(lead)
            else:
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
        self.mask = self.mask[:, lead:]

    def compact(self) -> None:
        """Move each row's real positions into a tight left-padded cache (removes rollback holes), one layer at a
        time: the old and new caches never coexist whole."""
        counts = self.mask.sum(1)
        new_w, b = int(counts.max()), self.mask.shape[0]
        order = torch.argsort(self.mask, dim=1, stable=True)[:, -new_w:] if new_w else self.mask[:, :0]

        def gathered(k, v):
            gi = order.view(b, 1, new_w, 1).expand(b, k.shape[1], new_w, k.shape[3])
            return k.gather(2, gi), v.gather(2, gi)

        self.cache = in_place_cache((gathered(k, v) for k, v in drain(self.cache)), self.max_columns)
        self.mask = (torch.arange(new_w, device=self.mask.device).unsqueeze(0) >= (new_w - counts).unsqueeze(1)).long()

    def concat(self, other: KVRows) -> KVRows:
        """Rows of ``self``, then of ``other``, in one batch of at most ``self.max_columns`` columns; both are
        consumed (emptied one layer at a time)."""
        width, pad = max(self.width, other.width), torch.nn.functional.pad
        pad_a, pad_b = (0, 0, width - self.width, 0), (0, 0, width - other.width, 0)  # columns, on the left
        layers = (
            (torch.cat([pad(ka, pad_a), pad(kb, pad_b)]), torch.cat([pad(va, pad_a), pad(vb, pad_b)]))
            for (ka, va), (kb, vb) in zip(drain(self.cache), drain(other.cache))
        )
        mask = torch.cat([pad(self.mask, pad_a[2:]), pad(other.mask, pad_b[2:])])
        return KVRows(in_place_cache(layers, self.max_columns), mask, self.max_columns)


@dataclass
class DecodeRow(Decoding):
    """One sequence being decoded into result ``out``: ``last`` sits at absolute ``position``."""

    out: int
    uid: int
    position: int
    proposer: object | None = None


class TailGate:
    """Feeds history-drafted tokens only while they pay on this hardware (docs/design.md "Tail speculation").

    A step computing T query positions costs about ``a + b T`` seconds: a least-squares line over the measured steps
    (recent ones weigh more), which says what width costs without trying it. Proposals are made every step, fed or
    not; ``q``, the chance a proposed token is accepted given the ones before it were, is counted on both (a proposal
    not fed is checked against the token sampled instead). A step of R rows feeds proposals (width W) when
    ``1 + p (q + ... + q^(W-1))`` tokens per row for ``a + b R W`` beat one token for ``a + b R`` (p: the share of
    rows with a proposal); at q >= :attr:`ALWAYS_Q` they are always fed. On a GPU, where a wider step costs almost
    nothing more, speculation stays on; on a CPU it stays on only while enough proposals are accepted. Tokens never
    depend on it: a proposal changes how many forwards a row takes, not what it samples.
    """

    DECAY = 0.98  # weight of a step's cost measurement per later step
    ALWAYS_Q = 0.5  # proposals that usually hold are fed whatever the (noisy) timings say

    def __init__(self):
        self._sums = [0.0] * 5  # weighted 1, T, T^2, y, T y
        self.hits, self.trials = 1.0, 2.0  # q starts at 1/2

    @property
    def q(self) -> float:
        return self.hits / self.trials

    def line(self) -> tuple[float, float] | None:
        """(a, b) of the cost line, None until steps of two sizes were measured."""
        w, t, tt, y, ty = self._sums
        var = w * tt - t * t
        if w <= 0 or var <= 1e-9 * max(w * tt, 1e-30):
            return None
        b = max((w * ty - t * y) / var, 0.0)
        return max((y - b * t) / w, 1e-9), b

    def speculate(self, rows: int, width: int, proposing: int) -> bool:
        """Whether a step of ``rows`` rows, ``proposing`` of them with proposals, should run at ``width``."""
        line = self.line()
        if line is None or width <= 1 or self.q >= self.ALWAYS_Q:
            return width > 1
        a, b = line
        gain = 1 + proposing / rows * sum(self.q**j for j in range(1, width))
        return gain * (a + b * rows) > a + b * rows * width

    def record(self, positions: int, seconds: float, hits: int, trials: int) -> None:
        """One step: ``positions`` query positions took ``seconds``; ``hits`` of ``trials`` proposed tokens held."""
        d = self.DECAY
        for i, v in enumerate((1.0, positions, positions * positions, seconds, positions * seconds)):
            self._sums[i] = d * self._sums[i] + v
        self.hits, self.trials = d * self.hits + hits, d * self.trials + trials


class SpeculativeDecoder:
    """The decode loop of one batch sharing a :class:`KVRows`; a row's proposer proposes up to its ``max_k`` tokens.
    Forwards, rows, positions (padding included) and proposed and accepted tokens are counted in ``stats``."""

    def __init__(
        self, model, settings: SamplingSettings, seed: int, eos_ids, pad_id: int, on_step=None, gate=None, stats=None
    ):
        self.model = model
        self.gate = gate
        self.settings = settings
        self.seed = check_seed(seed)
        self.eos = {int(e) for e in eos_ids}
        self.pad_id = int(pad_id)
        self.on_step = on_step
        self.cache_arg = cache_argument(model)
        self.stats = stats if stats is not None else BackendStats()

    def sample(self, logits: torch.Tensor, uids: Sequence[int], positions: Sequence[int]):
        uids = torch.tensor(list(uids), dtype=torch.long, device=logits.device)
        positions = torch.tensor(list(positions), dtype=torch.long, device=logits.device)
        ids, lps = keyed_sample(logits, self.settings, self.seed, uids, positions)
        return ids.tolist(), lps.tolist()

    @torch.no_grad()
    def run(self, kv: KVRows, rows: list[DecodeRow]) -> None:
        """Decode every row until EOS or its budget; rows are updated in place."""
        keep = [i for i, r in enumerate(rows) if r.finish is None]
        live = [rows[i] for i in keep]
        if live and len(live) != len(rows):
            kv.select(torch.tensor(keep, dtype=torch.long, device=kv.mask.device))
        while live:
            self._step(kv, live)
            keep = [i for i, r in enumerate(live) if r.finish is None]
            if len(keep) < len(live) and (not keep or len(keep) * 4 <= 3 * len(live)):
                live = [live[i] for i in keep]
                if live:
                    kv.select(torch.tensor(keep, dtype=torch.long, device=kv.mask.device))
                    kv.trim_front()  # the rows that left may have been the longest contexts
            # Finished rows ride along until a quarter is done: dropping each would copy the cache every step.
            if live and kv.width > 2 * int(kv.mask.sum(1).max()) + 16:
                kv.compact()

    def _inputs(self, rows: list[DecodeRow], active: list[bool]):
        """Per row [last, fed proposal] right-padded, the fed positions, and the proposals held back by the gate;
        proposals fill the width, computed anyway."""
        props = [
            r.proposer.propose(min(r.proposer.max_k, r.budget - 1), fill=r.proposer.max_k)
            if ok and r.proposer is not None and r.budget > 1
            else []
            for r, ok in zip(rows, active)
        ]
        held = [[] for _ in rows]
        width = 1 + max((len(p) for p in props), default=0)
        if self.gate is not None and not self.gate.speculate(len(rows), width, sum(1 for p in props if p)):
            props, held = held, props
        lens = torch.tensor([len(p) for p in props], dtype=torch.long)
        width = 1 + int(lens.max())
        pad = [self.pad_id] * width
        ids = torch.tensor([[r.last, *p, *pad[len(p) + 1 :]] for r, p in zip(rows, props)], dtype=torch.long)
        # A finished row feeds a query its context still answers, but no column of its own: it stops growing.
        fed = (torch.arange(width).unsqueeze(0) <= lens.unsqueeze(1)) & torch.tensor(active).unsqueeze(1)
        return props, held, lens, ids, fed

    def _step(self, kv: KVRows, rows: list[DecodeRow]) -> None:
        t0 = time.perf_counter()
        dev = kv.mask.device
        active = [r.finish is None for r in rows]
        props, held, lens, ids, fed = self._inputs(rows, active)
        width = ids.shape[1]
        positions = torch.tensor([r.position for r in rows], dtype=torch.long).unsqueeze(1) + torch.arange(width)
        if kv.max_columns is not None and kv.width + width > kv.max_columns:
            kv.compact()  # rolled-back columns make room: a row's tokens and this step fit its context + budget
        kv.mask = torch.cat([kv.mask, fed.to(dev, torch.long)], dim=1)
        with decode_attention(self.model):
            out = self.model(
                input_ids=ids.to(dev),
                attention_mask=_attention_mask(self.model, kv.mask, positions),
                position_ids=positions.to(dev),
                use_cache=True,
                **{self.cache_arg: kv.cache},
            )
        kv.cache = returned_cache(self.model, out)
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(rows)
        self.stats.decode_positions += len(rows) * width
        want = fed & torch.tensor(active).unsqueeze(1)
        at_row, at_col = want.nonzero().unbind(1)
        logits = out.logits[at_row.to(dev), at_col.to(dev)].float()
        uids = torch.tensor([r.uid for r in rows], dtype=torch.long)[at_row].to(dev)
        toks, lps = keyed_sample(logits, self.settings, self.seed, uids, (positions[at_row, at_col] + 1).to(dev))
        samples = torch.full((len(rows), width), -1, dtype=torch.long)
        samples[want] = toks.cpu()
        logps = torch.zeros((len(rows), width), dtype=torch.float32)
        logps[want] = lps.cpu()
        col = torch.arange(width)
        match = (samples[:, :-1] == ids[:, 1:]) & (col[:-1].unsqueeze(0) < lens.unsqueeze(1))
        accepted = match.long().cumprod(1).sum(1)
        kv.mask[:, -width:] *= (col.unsqueeze(0) <= accepted.unsqueeze(1)).to(dev, torch.long)
        s_rows, lp_rows, acc = samples.tolist(), logps.tolist(), accepted.tolist()  # syncs: the step is done
        hits = trials = 0
        for i, r in enumerate(rows):
            if not active[i]:
                continue
            if props[i]:  # accepted tokens, and the first rejected one when the proposal did not run out
                hits += acc[i]
                trials += acc[i] + (acc[i] < len(props[i]))
            elif held[i]:  # checked against the sample instead
                hits += held[i][0] == s_rows[i][0]
                trials += 1
            kept = r.emit(s_rows[i][: acc[i] + 1], lp_rows[i][: acc[i] + 1], self.eos)
            self.stats.proposed_tokens += len(props[i])
            self.stats.accepted_tokens += min(acc[i], kept)
            if r.proposer is not None:
                r.proposer.update(props[i], r.tokens[-kept:])
            r.position += kept
        if self.gate is not None:
            self.gate.record(len(rows) * width, time.perf_counter() - t0, hits, trials)
        if self.on_step is not None:
            self.on_step(sum(active))


def prefill(
    model, contexts: Sequence[Sequence[int]], pad_id: int, max_columns: int | None = None
) -> tuple[KVRows, torch.Tensor]:
    """One forward over left-padded contexts: (:class:`KVRows` of at most ``max_columns`` columns, last logits [B, V]);
    identical contexts run once."""
    device = next(model.parameters()).device
    index: dict[tuple[int, ...], int] = {}
    row_of = [index.setdefault(tuple(int(t) for t in c), len(index)) for c in contexts]
    distinct = list(index)
    ids, mask = padded_ids(distinct, int(pad_id), device, left=True)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # A sliding model gets a cache of ours: transformers' own drops keys past the window, which later steps mask.
    own = {cache_argument(model): DynamicCache()} if model_sliding_window(model) is not None else {}
    with torch.no_grad():
        out = model(
            input_ids=ids,
            attention_mask=_attention_mask(model, mask, positions),
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **own,
        )
    cache, logits = returned_cache(model, out), out.logits[:, -1, :]
    del out
    if len(distinct) == len(contexts):
        return KVRows(in_place_cache(drain(cache), max_columns), mask, max_columns), logits
    rows = torch.tensor(row_of, dtype=torch.long, device=device)
    layers = ((k.index_select(0, rows), v.index_select(0, rows)) for k, v in drain(cache))
    kv = KVRows(in_place_cache(layers, max_columns), mask.index_select(0, rows), max_columns)
    return kv, logits.index_select(0, rows)
