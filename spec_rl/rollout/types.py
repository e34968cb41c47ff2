"""What a speculative rollout takes and returns: requests and their checks, per-step statistics, results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from ..backends.base import token_ids
from ..drafts.cache import Draft, DraftStore
from ..util.validation import check_type


@dataclass
class RolloutRequest:
    """One sample to produce: prompt ids, its slot in the group, and an optional dataset id."""

    prompt_ids: Sequence[int]
    slot: int = 0
    dataset_id: str | None = None


def request_prompts(requests: Sequence[RolloutRequest], vocab_size: int | None, owner: str) -> list[list[int]]:
    """The prompts as non-empty id lists in [0, vocab_size); TypeError or ValueError naming the request."""
    prompts = []
    for i, r in enumerate(check_type("requests", requests, Sequence, "a list of RolloutRequest")):
        check_type(f"requests[{i}]", r, RolloutRequest)
        prompts.append(token_ids(f"requests[{i}].prompt_ids", r.prompt_ids, vocab_size, owner))
        if not prompts[-1]:
            raise ValueError(f"requests[{i}] has an empty prompt")
    return prompts


def check_store(name: str, store) -> DraftStore:
    """``store`` if it is a :class:`~spec_rl.drafts.cache.DraftStore`, else a TypeError naming ``name``."""
    return check_type(name, store, DraftStore, "a DraftStore (RolloutCache, DirectoryDraftStore)")


def check_draft_ids(drafts: Sequence[Draft | None], rows: Sequence[int], vocab_size: int | None, owner: str) -> None:
    """ValueError naming the request whose stored draft holds an id outside [0, vocab_size)."""
    for i in rows:
        ids = drafts[i].token_ids
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            where = f"[0, {vocab_size}) (the vocabulary of {owner})" if vocab_size else "the ids >= 0"
            raise ValueError(
                f"the stored draft of requests[{i}] holds token id {low if low < 0 else high} outside {where}: the "
                "store was filled by another model or tokenizer; start from a fresh one"
            )


def check_unique_samples(keys: Sequence) -> None:
    """ValueError naming two requests with one cache key: they would share a uid, hence one response."""
    first: dict[bytes, int] = {}
    for i, key in enumerate(keys):
        j = first.setdefault(key.digest, i)
        if j != i:
            raise ValueError(
                f"requests[{j}] and requests[{i}] are the same sample (same prompt, slot and dataset_id): they would "
                "share one cache entry and one sampling key; give the samples of a prompt distinct slots 0..G-1, "
                "and repeated prompts distinct dataset_id values"
            )


@dataclass
class RolloutStats:
    """Per-step rollout statistics (docs/api.md "Rollout"): ``decode_steps`` counts sequential generation forwards after
    scoring, ``longest_continuation`` the most tokens one sample generated (token at n included), ``reused_drift`` is
    the mean abs(lp_new - lp_old) of reused tokens in nats."""

    num_samples: int = 0
    drafts_found: int = 0
    drafts_dropped: int = 0  # past max_draft_age, or (residual draw) of a step whose weights are not kept
    draft_tokens: int = 0
    accepted_tokens: int = 0
    full_reuse_count: int = 0
    tokens_generated: int = 0
    vanilla_tokens: int = 0
    scoring_seconds: float = 0.0
    generation_seconds: float = 0.0
    assembly_seconds: float = 0.0
    reprefill_tokens: int = 0
    decode_steps: int = 0
    longest_continuation: int = 0
    tail_proposed: int = 0
    tail_accepted: int = 0
    decode_rows: int = 0
    decode_positions: int = 0
    log_lenience: float = 0.0
    reused_drift: float | None = 0.0  # None: the rule does not measure it (exact)

    @property
    def full_reuse_ratio(self) -> float:
        """Fraction of all samples whose response was reused whole."""
        return self.full_reuse_count / self.num_samples if self.num_samples else 0.0

    @property
    def mean_verified_prefix(self) -> float:
        """Mean verified-prefix length n (tokens) over samples that had a draft."""
        return self.accepted_tokens / self.drafts_found if self.drafts_found else 0.0

    @property
    def rollout_seconds(self) -> float:
        return self.scoring_seconds + self.generation_seconds + self.assembly_seconds

    def to_dict(self) -> dict:
        derived = ("full_reuse_ratio", "mean_verified_prefix", "rollout_seconds")
        return {**asdict(self), **{k: getattr(self, k) for k in derived}, "reused_tokens": self.accepted_tokens}


@dataclass
class RolloutResult:
    """Responses for B requests in request order. ``logprobs``: per token, the log-prob under the rollout's policy (the
    "old" log-probs of the update); ``behaviour_logprobs``: the log-prob of the path that produced the token, the
    policy that sampled it (docs/design.md "Behaviour log-probs": the current one for a generated token, the draft's
    times the test's keep probability for a kept one), which a rollout correction weighs against ``logprobs``; the
    first ``verified_prefix_len`` tokens of a response were reused from its draft (:meth:`reused_mask`)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    verified_prefix_len: list[int]
    draft_found: list[bool]
    stats: RolloutStats = field(default_factory=RolloutStats)
    behaviour_logprobs: list[list[float]] | None = None  # None: the logprobs (nothing was reused off-policy)

    def __post_init__(self) -> None:
        if self.behaviour_logprobs is None:
            self.behaviour_logprobs = [list(lp) for lp in self.logprobs]

    @property
    def truncated(self) -> list[bool]:
        return [r == "length" for r in self.finish_reasons]

    def reused_mask(self) -> list[list[bool]]:
        """Per token, whether it was kept from the response's draft (the verified prefix)."""
        return [[i < n for i in range(len(r))] for r, n in zip(self.response_ids, self.verified_prefix_len)]

    def padded(self, pad_id: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Right-padded response_ids [B, R] int64, response_mask [B, R] bool, logprobs and behaviour_logprobs
        [B, R] float32 (0 at padding), reused_mask [B, R] bool."""
        bsz = len(self.response_ids)
        width = max([len(r) for r in self.response_ids] + [1])
        ids = torch.full((bsz, width), pad_id, dtype=torch.long)
        mask = torch.zeros((bsz, width), dtype=torch.bool)
        lps = torch.zeros((2, bsz, width), dtype=torch.float32)
        for b, (r, lp, bh) in enumerate(zip(self.response_ids, self.logprobs, self.behaviour_logprobs)):
            ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[b, : len(r)] = True
            lps[:, b, : len(r)] = torch.tensor([lp, bh], dtype=torch.float32)
        reused = torch.arange(width).unsqueeze(0) < torch.tensor(self.verified_prefix_len).unsqueeze(1)
        out = {"response_ids": ids, "response_mask": mask, "logprobs": lps[0], "behaviour_logprobs": lps[1]}
        return {k: v.to(device) for k, v in {**out, "reused_mask": reused & mask}.items()}
