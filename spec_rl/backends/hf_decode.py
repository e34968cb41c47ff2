"""Decoding over a transformers KV cache: keyed sampling, multi-token speculation, rollback by masking.

Used by :class:`spec_rl.backends.transformers_backend.TransformersBackend`. Rows of a batch sit left-padded in one
``DynamicCache``; :class:`KVRows` keeps, beside the cache, the attention mask of every cached
position (1 = a real token of that row). Each decode step feeds, per row, the last sampled token
followed by up to k proposed tokens (drafts from the prompt's history, :mod:`spec_rl.drafts.history`), runs
ONE forward, samples a token at every fed position with :func:`~spec_rl.sampling.distribution.keyed_sample` and
keeps the longest run of proposals that equal the samples, plus the sample after it. A proposal is
accepted exactly when the token the policy samples at its position (with that position's keyed
uniform) is the proposal itself, so the output is token for token what plain one-token-per-step
decoding would produce: the rollout distribution is unchanged (lossless), and a proposed token is
accepted with probability p_t(token), as in exact speculative sampling with a point-mass draft.

Rejected positions are rolled back by setting their mask to 0 (their K/V stay in the cache as holes);
when holes make the cache much wider than its longest row, :meth:`KVRows.compact` gathers each row's
real positions into a fresh, tightly left-padded cache, and when the longest rows leave the batch,
:meth:`KVRows.trim_front` drops the left padding no remaining row needs.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..sampling.distribution import SamplingSettings, keyed_sample
from .kv_buffer import InPlaceLayer, in_place_cache, left_padded_cache
from .step_correction import StepCorrection, StepTimer
from .step_cost import ProposalBackoff, StepCost, acceptance_of, fastest_run, plan_proposals


def cache_argument(model) -> str:
    """transformers >= 5.24 names the KV cache argument ``cache``; earlier versions ``past_key_values``."""
    return _cache_argument_of(type(model))


@functools.lru_cache(maxsize=None)
def _cache_argument_of(model_class: type) -> str:  # inspect.signature per forward cost ~1% of a scoring call
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _dynamic_cache(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]):
    return in_place_cache(layers)  # decode steps append in place (no torch.cat of the whole cache per step)


def _layers_of(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


@dataclass
class KVRows:
    """A left-padded batch in a ``DynamicCache`` with a per-position mask.

    Attributes:
        cache: the transformers cache (None before the first forward).
        mask: [B, W] int64, 1 where the cache position holds a real token of the row.
    """

    cache: object
    mask: torch.Tensor

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (finished rows leave the batch)."""
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]

    def trim_front(self, min_columns: int = 8) -> None:
        """Drop the leading columns that are padding in every row (left padding of contexts longer than any
        left in the batch), when at least ``min_columns``: attention then reads fewer columns per step."""
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
        """Move each row's real positions into a tight left-padded cache (removes rollback holes)."""
        counts = self.mask.sum(1)
        new_w = int(counts.max())
        b = self.mask.shape[0]
        # Row r's real positions, in order, right-aligned into new_w columns.
        order = torch.argsort(self.mask, dim=1, stable=True)[:, -new_w:] if new_w else self.mask[:, :0]
        idx = order
        new_mask = (torch.arange(new_w, device=self.mask.device).unsqueeze(0) >= (new_w - counts).unsqueeze(1)).long()
        layers = []
        for k, v in _layers_of(self.cache):
            gi = idx.view(b, 1, new_w, 1).expand(b, k.shape[1], new_w, k.shape[3])
            layers.append((k.gather(2, gi), v.gather(2, gi)))
        self.cache = _dynamic_cache(layers)
        self.mask = new_mask

    @classmethod
    def from_rows(cls, rows: Sequence[list[tuple[torch.Tensor, torch.Tensor]]]) -> "KVRows":
        """Build a left-padded batch from per-row K/V, each row a list over layers of ([H, L_r, D], [H, L_r, D])."""
        return cls(*left_padded_cache(rows))

    def concat(self, other: "KVRows") -> "KVRows":
        """Rows of ``self`` then rows of ``other`` in one batch (the narrower one padded on the left)."""
        width = max(self.width, other.width)

        def widen(kv: KVRows):
            pad = width - kv.width
            layers = [(torch.nn.functional.pad(k, (0, 0, pad, 0)), torch.nn.functional.pad(v, (0, 0, pad, 0))) for k, v in _layers_of(kv.cache)]
            return layers, torch.nn.functional.pad(kv.mask, (pad, 0))

        a, ma = widen(self)
        b, mb = widen(other)
        layers = [(torch.cat([ka, kb]), torch.cat([va, vb])) for (ka, va), (kb, vb) in zip(a, b)]
        return KVRows(_dynamic_cache(layers), torch.cat([ma, mb]))


@dataclass
class DecodeRow:
    """One sequence being decoded.

    Attributes:
        out: index of the row in the caller's results.
        uid: key of its sampling uniforms.
        last: the newest sampled token (its K/V is not in the cache yet).
        position: absolute position of ``last`` in the sequence.
        budget: tokens it may still emit (``last`` already counted).
        proposer: drafts for its next tokens (:class:`~spec_rl.drafts.history.SuffixProposer`) or None.
    """

    out: int
    uid: int
    last: int
    position: int
    budget: int
    proposer: object | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None


@dataclass
class DecodeCounters:
    """What a decode loop did: forwards (sequential steps), proposed and accepted draft tokens."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    rows: int = 0  # sequences per forward, summed over steps
    positions: int = 0  # query positions computed, padding included


def _emit(row: DecodeRow, tokens: list[int], logprobs: list[float], eos: set[int]) -> int:
    """Append up to the first EOS; returns how many tokens were kept."""
    kept = len(tokens)
    for i, t in enumerate(tokens):
        if t in eos:
            kept = i + 1
            row.finish = "eos"
            break
    row.tokens += tokens[:kept]
    row.logprobs += logprobs[:kept]
    row.budget -= kept
    if row.finish is None and row.budget <= 0:
        row.finish = "length"
    return kept


class SpeculativeDecoder:
    """The decode loop (see the module docstring) for one batch of rows sharing a :class:`KVRows`.

    Args:
        model: a transformers causal LM.
        settings: sampling settings.
        seed: seed of the keyed uniforms.
        eos_ids: the complete EOS set.
        max_k: most proposed tokens per row and step (0: no speculation).
        pad_id: id fed at padding positions.
        on_step: called with the number of live rows after every forward (progress bars).
        step_cost: returns the backend's :class:`~spec_rl.backends.step_cost.StepCost` (called only when a
            row has a proposal; default: a flat cost, i.e. always verify every proposed token).
        correction: the backend's :class:`~spec_rl.backends.step_correction.StepCorrection`, which this loop's
            steps are timed for and which prices its wide steps; None: the table as measured.
    """

    def __init__(self, model, settings: SamplingSettings, seed: int, eos_ids, max_k: int, pad_id: int, on_step=None,
                 step_cost=StepCost.flat, correction: StepCorrection | None = None):  # fmt: skip
        self.model = model
        self.settings = settings
        self.seed = int(seed)
        self.eos = {int(e) for e in eos_ids}
        self.max_k = int(max_k)
        self.pad_id = int(pad_id)
        self.on_step = on_step
        self.step_cost = step_cost  # called (once measured, then cached) only when a row has a proposal
        self.cache_arg = cache_argument(model)
        self.counters = DecodeCounters()
        self.backoff = ProposalBackoff()  # stops asking proposers while speculation does not pay
        self.timer = StepTimer(correction)  # times the steps for the correction, which prices the wide ones

    def sample(self, logits: torch.Tensor, uids: Sequence[int], positions: Sequence[int]):
        dev = logits.device
        ids, lps = keyed_sample(
            logits, self.settings, self.seed, torch.tensor(list(uids), dtype=torch.long, device=dev),
            torch.tensor(list(positions), dtype=torch.long, device=dev),
        )  # fmt: skip
        return ids.tolist(), lps.tolist()

    @torch.no_grad()
    def run(self, kv: KVRows, rows: list[DecodeRow]) -> None:
        """Decode every row until EOS or its budget; rows are updated in place."""
        live = [r for r in rows if r.finish is None]
        if not live:
            return
        if len(live) != len(rows):
            kv.select(torch.tensor([i for i, r in enumerate(rows) if r.finish is None], dtype=torch.long, device=kv.mask.device))
        while live:
            shape = (len(live), kv.width)  # rows, cached columns attention reads
            width = self._step(kv, live)
            keep = [i for i, r in enumerate(live) if r.finish is None]
            if len(keep) < len(live) and (not keep or len(keep) * 4 <= 3 * len(live)):
                live = [live[i] for i in keep]
                if live:
                    kv.select(torch.tensor(keep, dtype=torch.long, device=kv.mask.device))
                    kv.trim_front()  # the rows that left may have been the longest contexts
            # Otherwise finished rows ride along until a quarter of the batch is done: they sample
            # nothing, but dropping them one by one would copy the whole cache every step.
            if live and kv.width > 2 * int(kv.mask.sum(1).max()) + 16:
                kv.compact()
            self.timer.stop(shape[0], shape[0] * width, shape[1])  # rollback and compaction included

    def _inputs(self, rows: list[DecodeRow], active: list[bool], context: int):
        """Per row: [last token, proposal...] right-padded to one width; which positions are fed.

        Each live row's proposer offers up to min(max_k, budget - 1) tokens; :func:`plan_proposals`
        picks the width that maximises expected tokens per second under the measured step cost at ``context``
        cached columns (the padded width attention reads; one token when no row has a proposal or when
        speculation does not pay), and every row is fed
        its proposal up to that width (padding is computed anyway, so a shorter row's own tokens fill it).
        While speculation does not pay, :class:`~spec_rl.backends.step_cost.ProposalBackoff` skips asking the
        proposers (their lookups cost host time per row).
        """
        live = sum(active)
        ask = self.max_k > 0 and self.backoff.ask(live)
        cands = [r.proposer.propose(min(self.max_k, r.budget - 1), fill=self.max_k)
                 if ask and ok and r.proposer is not None and r.budget > 1 else []
                 for r, ok in zip(rows, active)]  # fmt: skip
        props = cands
        if any(cands):
            cost = self.timer.price(self.step_cost(), len(rows))
            props = plan_proposals(cands, [acceptance_of(r.proposer) for r in rows], cost, padded=True, context=context)
            props = self.backoff.explore(props, cands, cost, padded=True, context=context)
            self.backoff.planned(live, fed=any(props))
        lens = torch.tensor([len(p) for p in props], dtype=torch.long)
        width = 1 + int(lens.max())
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        ids[:, 0] = torch.tensor([r.last for r in rows], dtype=torch.long)
        flat = [t for p in props for t in p]
        if flat:
            row_of = torch.repeat_interleave(torch.arange(len(rows)), lens)
            col_of = torch.arange(len(flat)) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens) + 1
            ids[row_of, col_of] = torch.tensor(flat, dtype=torch.long)
        col = torch.arange(width)
        fed = (col.unsqueeze(0) <= lens.unsqueeze(1)) & torch.tensor(active).unsqueeze(1)
        fed[:, 0] = True  # finished rows keep one valid query so attention never sees an empty row
        return props, lens, ids, fed

    def _step(self, kv: KVRows, rows: list[DecodeRow]) -> int:
        """One forward over every row; returns its width (fed positions per row)."""
        dev = kv.mask.device
        active = [r.finish is None for r in rows]
        props, lens, ids, fed = self._inputs(rows, active, kv.width)
        self.timer.start()  # the proposers' lookups are spent whatever the plan: not part of the step's price
        width = ids.shape[1]
        positions = torch.tensor([r.position for r in rows], dtype=torch.long).unsqueeze(1) + torch.arange(width)
        kv.mask = torch.cat([kv.mask, fed.to(dev, torch.long)], dim=1)
        out = self.model(
            input_ids=ids.to(dev), attention_mask=kv.mask, position_ids=positions.to(dev), use_cache=True,
            **{self.cache_arg: kv.cache},
        )  # fmt: skip
        kv.cache = getattr(out, self.cache_arg, None) or getattr(out, "past_key_values", None)
        self.counters.steps += 1
        self.counters.rows += len(rows)
        self.counters.positions += len(rows) * width
        # A sample after every fed position of the live rows, keyed by the position it fills.
        want = fed & torch.tensor(active).unsqueeze(1)
        where = want.nonzero()
        uid_t = torch.tensor([r.uid for r in rows], dtype=torch.long)
        toks, lps = keyed_sample(
            out.logits[where[:, 0].to(dev), where[:, 1].to(dev)].float(), self.settings, self.seed,
            uid_t[where[:, 0]].to(dev), (positions[where[:, 0], where[:, 1]] + 1).to(dev),
        )  # fmt: skip
        samples = torch.full((len(rows), width), -1, dtype=torch.long)
        samples[want] = toks.cpu()
        logps = torch.zeros((len(rows), width), dtype=torch.float32)
        logps[want] = lps.cpu()
        col = torch.arange(width)
        # Proposal j+1 is accepted while every sample so far equals the proposal it checks.
        match = (samples[:, :-1] == ids[:, 1:]) & (col[:-1].unsqueeze(0) < lens.unsqueeze(1))
        accepted = match.long().cumprod(1).sum(1)
        # Fed positions past the accepted ones hold K/V of rejected proposals: roll them back.
        kv.mask[:, -width:] *= (col.unsqueeze(0) <= accepted.unsqueeze(1)).to(dev, torch.long)
        s_rows, lp_rows, acc = samples.tolist(), logps.tolist(), accepted.tolist()
        for i, r in enumerate(rows):
            if not active[i]:
                continue
            kept = _emit(r, s_rows[i][: acc[i] + 1], lp_rows[i][: acc[i] + 1], self.eos)
            self.counters.proposed += len(props[i])
            self.counters.accepted += min(acc[i], kept)
            if r.proposer is not None:
                r.proposer.update(props[i], r.tokens[-kept:])
            r.last = r.tokens[-1]
            r.position += kept
        if self.on_step is not None:
            self.on_step(sum(active))
        return width


def prefill(model, contexts: Sequence[Sequence[int]], pad_id: int) -> tuple[KVRows, torch.Tensor]:
    """One forward over left-padded contexts: (the batch's :class:`KVRows`, logits [B, V] at each last position).

    Identical contexts (the G samples of one prompt) are computed once and their K/V copied to every
    row that holds them (prefix sharing, as vLLM's prefix cache does): a GRPO batch of G samples per
    prompt prefills 1/G of its tokens. Each row's values are those of a forward over its own context.
    """
    device = next(model.parameters()).device
    index: dict[tuple[int, ...], int] = {}
    row_of = [index.setdefault(tuple(int(t) for t in c), len(index)) for c in contexts]
    distinct = list(index)
    width = max(len(c) for c in distinct)
    ids = torch.full((len(distinct), width), int(pad_id), dtype=torch.long, device=device)
    mask = torch.zeros((len(distinct), width), dtype=torch.long, device=device)
    for row, ctx in enumerate(distinct):
        ids[row, width - len(ctx) :] = torch.as_tensor(ctx, dtype=torch.long)
        mask[row, width - len(ctx) :] = 1
    arg = cache_argument(model)
    with torch.no_grad():
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True,
            logits_to_keep=1,
        )  # fmt: skip
    cache = getattr(out, arg, None) or getattr(out, "past_key_values", None)
    logits = out.logits[:, -1, :]
    if len(distinct) == len(contexts):
        return KVRows(_dynamic_cache(_layers_of(cache)), mask), logits
    rows = torch.tensor(row_of, dtype=torch.long, device=device)
    layers = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in _layers_of(cache)]
    return KVRows(_dynamic_cache(layers), mask.index_select(0, rows)), logits.index_select(0, rows)


class DecodeStepTimer:
    """Times decode steps: the points of the backend's :class:`~spec_rl.backends.step_cost.StepCost`.

    ``timer(rows, width, context)`` returns the seconds of one decode step (forward + keyed samples at every
    fed position) over ``rows`` sequences of ``context`` cached tokens feeding ``width`` tokens each, the
    fastest of ``repeats`` (:func:`~spec_rl.backends.step_cost.fastest_run`). Random ids. The prefilled batch
    of the latest (rows, context) is kept and cropped back after each run, so timing every width of one
    batch prefills it once (a prefill of 256 rows x 320 tokens costs about a second on the demo's CPU).
    """

    def __init__(self, model, pad_id: int, repeats: int = 5):
        self.model, self.pad_id, self.repeats = model, int(pad_id), int(repeats)
        self._batch: tuple[tuple[int, int], KVRows] | None = None

    def _prefilled(self, rows: int, context: int) -> KVRows:
        if self._batch is None or self._batch[0] != (rows, context):
            self._batch = None  # free the previous batch before building the next
            vocab = self.model.get_output_embeddings().weight.shape[0]
            gen = torch.Generator().manual_seed(rows * 31 + context)
            kv, _ = prefill(self.model, torch.randint(0, vocab, (rows, context), generator=gen).tolist(), self.pad_id)
            self._batch = ((rows, context), kv)
        return self._batch[1]

    @torch.no_grad()
    def __call__(self, rows: int, width: int, context: int = 64) -> float:
        kv = self._prefilled(rows, context)
        device = next(self.model.parameters()).device
        vocab = self.model.get_output_embeddings().weight.shape[0]
        gen = torch.Generator().manual_seed(rows * 31 + width)
        arg, settings = cache_argument(self.model), SamplingSettings(max_tokens=width)
        uids = torch.arange(rows * width, device=device)
        mask = torch.cat([kv.mask, torch.ones((rows, width), dtype=torch.long, device=device)], dim=1)
        positions = (context + torch.arange(width, device=device)).unsqueeze(0).expand(rows, width)
        inputs = [torch.randint(0, vocab, (rows, width), generator=gen).to(device) for _ in range(self.repeats + 1)]

        def step(i: int) -> None:
            out = self.model(input_ids=inputs[i], attention_mask=mask, position_ids=positions, use_cache=True, **{arg: kv.cache})
            keyed_sample(out.logits.reshape(rows * width, -1).float(), settings, 0, uids, positions.reshape(-1))

        return fastest_run(step, device, self.repeats, after=lambda: kv.cache.crop(-width))  # drop the fed positions again


def time_decode_step(model, rows: int, width: int, pad_id: int, context: int = 64, repeats: int = 5) -> float:
    """Seconds of one decode step over a freshly prefilled batch (:class:`DecodeStepTimer`, one point)."""
    return DecodeStepTimer(model, pad_id, repeats)(rows, width, context)
