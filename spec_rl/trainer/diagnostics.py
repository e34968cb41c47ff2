"""Policy diagnostics per epoch: entropy and KL to the warm start, per response token (nats), on held-out samples.

Both use softmax(logits / T) over the full vocabulary: top-k / top-p would make the KL infinite wherever the warm start
cut a token the policy keeps. The KL is the exact sum over the vocabulary, so it is >= 0."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..backends.scoring import response_states

#: Fields :func:`policy_drift` adds to a held-out evaluation (nats per response token).
DIAGNOSTIC_FIELDS = ("heldout_entropy", "heldout_kl_to_init")
#: Logits per forward chunk (rows x positions x vocabulary): bounds memory on large vocabularies.
_CHUNK_ELEMENTS = 1 << 24


def _log_probs(model, prompts, responses, pad_id: int, temperature: float) -> torch.Tensor:
    return torch.log_softmax(response_states(model, prompts, responses, pad_id).float() / temperature, dim=-1)


@torch.no_grad()
def policy_drift(
    model,
    reference,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
    temperature: float = 1.0,
) -> dict[str, float]:
    """Mean per-token entropy of ``model`` and KL(model || reference) in nats over the responses (token ids; response
    i follows prompt i; empty ones skipped). ``reference`` None: no ``heldout_kl_to_init``."""
    rows = [i for i, r in enumerate(responses) if len(r) > 0]
    vocab = model.get_output_embeddings().weight.shape[0]
    longest = max([len(responses[i]) for i in rows] + [1])
    per_chunk = max(1, _CHUNK_ELEMENTS // (longest * vocab))
    entropy, kl, tokens = 0.0, 0.0, 0
    for start in range(0, len(rows), per_chunk):
        chunk = rows[start : start + per_chunk]
        ps, rs = [prompts[i] for i in chunk], [responses[i] for i in chunk]
        logp = _log_probs(model, ps, rs, pad_id, temperature)
        lengths = torch.tensor([len(r) for r in rs], device=logp.device)
        mask = torch.arange(logp.shape[1], device=logp.device) < lengths.unsqueeze(1)  # [rows, positions]
        p = logp.exp()
        entropy += float((-(p * logp).sum(-1))[mask].sum())
        if reference is not None:
            logq = _log_probs(reference, ps, rs, pad_id, temperature)
            kl += float(((p * (logp - logq)).sum(-1))[mask].sum())
        tokens += int(mask.sum())
    out = {"heldout_entropy": entropy / max(tokens, 1)}
    if reference is not None:
        out["heldout_kl_to_init"] = max(kl, 0.0) / max(tokens, 1)  # >= 0 up to float rounding
    return out
