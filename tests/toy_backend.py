"""A backend written as a user would add one (not a test module): one file with a ReprefillBackend subclass that
decodes by a full forward per token, keyed like every spec-rl sampler; registered by one line in BACKENDS."""

from __future__ import annotations

import torch

from spec_rl.backends.base import BackendStats, Continuation, eos_and_pad
from spec_rl.backends.reprefill import ReprefillBackend
from spec_rl.backends.scoring import PolicyScorer
from spec_rl.sampling.distribution import keyed_sample


class FullForwardBackend(ReprefillBackend):
    """No KV cache: every token is a forward over the whole context."""

    def __init__(self, model, eos_ids, pad_id: int):
        self.model = model
        self.eos_ids, self.pad_id = eos_and_pad(eos_ids, pad_id)
        self.scorer = PolicyScorer(model, self.pad_id)
        self.stats = BackendStats()

    @torch.no_grad()
    def generate(self, jobs, settings, seed) -> list[Continuation]:
        out = []
        for job in self.checked_jobs(jobs):
            ids, lps = list(job.context), []
            while len(lps) < job.budget and (not lps or ids[-1] not in self.eos_ids):
                logits = self.model(input_ids=torch.tensor([ids])).logits[:, -1].float()
                token, lp = keyed_sample(logits, settings, seed, torch.tensor([job.uid]), torch.tensor([len(ids)]))
                ids.append(int(token))
                lps.append(float(lp))
                self.stats.decode_steps += 1
            tokens = ids[len(job.context) :]
            out.append(Continuation(tokens, lps, "eos" if tokens and tokens[-1] in self.eos_ids else "length"))
        return out
