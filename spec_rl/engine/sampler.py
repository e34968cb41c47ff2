"""Sampling side of the paged engine: keyed samples, history proposals and their acceptance.

Every token the engine samples is drawn with :func:`~spec_rl.sampling.distribution.keyed_sample` from a uniform
keyed by (seed, uid, absolute position) (docs/design.md "Randomness"): the token at position p of
sequence uid is a pure function of the seed and the logits there, whatever else is in the batch.

A decode step may also feed up to ``max_k`` tokens proposed from the prompt's history
(:class:`~spec_rl.drafts.history.SuffixProposer`) after the pending token. The policy samples at every fed
position; the proposals are accepted while they equal those samples, and the sample after the last
accepted one is kept too. A proposal is therefore accepted exactly when the keyed sample at its
position *is* that token, so a sequence comes out token for token as one-token-per-step decoding
would produce it (lossless; the same rule as :class:`spec_rl.backends.hf_decode.SpeculativeDecoder`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sampling.distribution import SamplingSettings, keyed_sample
from .sequence import SequenceState


class KeyedSampler:
    """Keyed sampling and draft acceptance for one ``generate``/``continue_from`` call.

    Parameters
    ----------
    settings:
        the sampling settings.
    seed:
        seed of the keyed uniforms.
    uids:
        per result row (the caller's result index), the uid that keys its uniforms.
    proposers:
        per result row, an object with ``propose(limit, fill) -> list[int]`` and
        ``update(proposal, emitted)`` (a :class:`~spec_rl.drafts.history.SuffixProposer`), or None.
        It must already know the row's response up to the engine's first sampled token;
        every token the engine samples for the row is reported to it through ``update``.
    max_k:
        most proposed tokens per sequence and step (0 turns speculation off).
    eos_ids:
        the complete EOS set.
    """

    def __init__(
        self,
        settings: SamplingSettings,
        seed: int,
        uids: Sequence[int],
        proposers: Sequence[object | None],
        max_k: int,
        eos_ids,
    ):
        self.settings = settings
        self.seed = int(seed)
        self.uids = [int(u) for u in uids]
        self.proposers = list(proposers)
        self.max_k = int(max_k)
        self.eos_ids = {int(e) for e in eos_ids}

    def proposal(self, seq: SequenceState) -> list[int]:
        """What ``seq``'s proposer offers after its pending token: at most ``min(max_k, budget - 1)``, so
        that the step never emits more than the budget and never needs more slots than the budget reserved."""
        proposer = self.proposers[seq.result_index]
        limit = min(self.max_k, seq.budget - 1)
        if proposer is None or limit <= 0:
            return []
        return [int(t) for t in proposer.propose(limit, fill=limit)][:limit]

    def proposals(self, seqs: Sequence[SequenceState]) -> list[list[int]]:
        """The tokens each sequence feeds after its pending one this step: its whole proposal (packed: each
        sequence feeds its own length, so a longer proposal costs nothing to the others)."""
        return [self.proposal(s) for s in seqs]

    def sample(
        self, seqs: Sequence[SequenceState], logits: torch.Tensor, positions: Sequence[int]
    ) -> tuple[list[int], list[float]]:
        """Keyed samples from ``logits`` [N, V]: row r is the token at absolute position
        ``positions[r]`` of ``seqs[r]`` (the number of tokens before it). Returns (ids, logprobs)."""
        dev = logits.device
        uids = torch.tensor([self.uids[s.result_index] for s in seqs], dtype=torch.long, device=dev)
        pos = torch.tensor(list(positions), dtype=torch.long, device=dev)
        ids, lps = keyed_sample(logits.float(), self.settings, self.seed, uids, pos)
        return ids.tolist(), lps.tolist()

    def record(
        self, seq: SequenceState, proposal: Sequence[int], samples: Sequence[int], logprobs: Sequence[float]
    ) -> tuple[int, int]:
        """Apply one step's samples to ``seq``: the proposals that equal the samples, then one more sample.

        ``samples[j]`` is the sample after fed token j (the pending token, then the proposals), so
        ``len(samples) == 1 + len(proposal)``. Emission stops at the first EOS or when the budget
        runs out; the proposer is told what was emitted.

        Returns
        -------
        (accepted, kept):
            proposals equal to their samples, and tokens appended to ``seq`` (<= accepted + 1).
        """
        accepted = 0
        while accepted < len(proposal) and samples[accepted] == proposal[accepted]:
            accepted += 1
        kept = 0
        for token, lp in zip(samples[: accepted + 1], logprobs[: accepted + 1]):
            seq.append(int(token), float(lp), self.eos_ids)
            kept += 1
            if seq.finished:
                break
        proposer = self.proposers[seq.result_index]
        if proposer is not None:
            proposer.update(list(proposal), [int(t) for t in samples[:kept]])
        return accepted, kept
