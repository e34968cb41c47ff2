"""Sampling side of the paged engine: keyed samples (docs/design.md "Randomness"), and history proposals kept iff they
equal the keyed sample at their position (lossless)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...drafts.history import matched_prefix
from ...sampling.distribution import SamplingSettings, check_seed, keyed_sample
from .sequence import SequenceState


class KeyedSampler:
    """Keyed sampling and proposal acceptance for one call's ``jobs`` (a sequence's ``result_index`` is its job's
    index); each job's proposer knows the response up to the engine's first sampled token."""

    def __init__(self, settings: SamplingSettings, seed: int, jobs: Sequence, eos_ids):
        self.settings = settings
        self.seed = check_seed(seed)
        self.uids = [int(j.uid) for j in jobs]
        self.proposers = [j.proposer for j in jobs]
        self.eos_ids = {int(e) for e in eos_ids}

    def proposal(self, seq: SequenceState) -> list[int]:
        """At most ``min(max_k, budget - 1)`` tokens, so a step stays within its reserved budget."""
        proposer = self.proposers[seq.result_index]
        limit = 0 if proposer is None else min(proposer.max_k, seq.budget - 1)
        return [int(t) for t in proposer.propose(limit, fill=limit)][:limit] if limit > 0 else []

    def sample(
        self, seqs: Sequence[SequenceState], logits: torch.Tensor, positions: Sequence[int]
    ) -> tuple[list[int], list[float]]:
        """Keyed (ids, logprobs) from ``logits`` [N, V]; row r is at absolute position ``positions[r]``."""
        dev = logits.device
        uids = torch.tensor([self.uids[s.result_index] for s in seqs], dtype=torch.long, device=dev)
        pos = torch.tensor(list(positions), dtype=torch.long, device=dev)
        ids, lps = keyed_sample(logits.float(), self.settings, self.seed, uids, pos)
        return ids.tolist(), lps.tolist()

    def record(
        self, seq: SequenceState, proposal: Sequence[int], samples: Sequence[int], logprobs: Sequence[float]
    ) -> tuple[int, int]:
        """Append the accepted proposals and the sample after them (to EOS or budget); returns (accepted, kept)."""
        accepted = matched_prefix(proposal, samples)
        kept = seq.emit(samples[: accepted + 1], logprobs[: accepted + 1], self.eos_ids)
        proposer = self.proposers[seq.result_index]
        if proposer is not None:
            proposer.update(list(proposal), seq.tokens[-kept:])
        return accepted, kept
