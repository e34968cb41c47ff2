"""The rollout cache: last epoch's response per (prompt, sample slot), reused as the draft. Keys hash the prompt's token
ids, never its text (docs/design.md "Facts from the field"); a lookup under other sampling settings is a miss
(docs/design.md "The rule", step 1). On disk: one safetensors file, written atomically, checked whole on load."""

from __future__ import annotations

import abc
import hashlib
import itertools
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..sampling.distribution import SamplingSettings, check_settings
from ..util.atomic import atomic_save_safetensors
from ..util.validation import (
    INT64_MAX,
    as_float_vector,
    as_id_vector,
    check_choice,
    check_int,
    check_type,
    logprob_problem,
)
from .owner import merged_owner
from .stored_files import open_stored

FINISH_REASONS = ("eos", "length")
_FORMAT = {"format": "spec-rl-rollout-cache", "format_version": "1"}
_KEY_BYTES = 16
_FIX = "delete the file or restore a backup (without a cache the next epoch generates every response afresh)"


@dataclass(frozen=True)
class CacheKey:
    """Identity of one draft: BLAKE2b hash of (dataset id, sample slot, prompt token ids). ``uid`` (63-bit, from the
    hash) keys this sample's uniforms, so its decisions do not depend on batch position."""

    digest: bytes

    @property
    def uid(self) -> int:
        return int.from_bytes(self.digest[:8], "little") & ((1 << 63) - 1)

    @classmethod
    def make(cls, prompt_ids: Sequence[int] | torch.Tensor, slot: int, dataset_id: str | None = None) -> CacheKey:
        """Key of ``prompt_ids`` (list, numpy array or 1-D integer tensor; ids in [0, 2**63)), ``slot`` >= 0 (the
        sample's index in its group) and an optional stable ``dataset_id`` (e.g. "gsm8k:17"). TypeError for
        non-integer ids (never rounded) or slot, or a non-str dataset id; ValueError for ids not 1-D or out of range,
        or a negative slot."""
        ids = as_id_vector("prompt_ids", prompt_ids, high=INT64_MAX)
        slot = check_int("slot", slot, low=0, high=INT64_MAX, hint=" (the sample's index within its group)")
        if dataset_id is not None and not isinstance(dataset_id, str):  # per sample: no message built unless needed
            raise TypeError(
                f"dataset_id must be a str or None, got {type(dataset_id).__name__} {dataset_id!r} "
                f'(e.g. dataset_id="gsm8k:{dataset_id}")'
            )
        h = hashlib.blake2b(digest_size=_KEY_BYTES, person=b"spec-rl-cache-1")
        h.update((dataset_id if dataset_id is not None else "\x00none").encode("utf-8"))
        h.update(b"\xff")
        h.update(slot.to_bytes(8, "little", signed=False))
        h.update(ids.cpu().contiguous().numpy().tobytes())  # int64 little-endian: part of the stored key format
        return cls(h.digest())


@dataclass
class Draft:
    """One cached response: ``token_ids`` [R] int32 (EOS included when it ended with one), ``logprobs`` [R] float32
    under the policy of ``version`` (the training step that last validated the tokens), ``finish_reason`` ("eos" or
    "length"), the ``settings`` it was sampled with, its ``age``: the epochs in a row its slot's response came from
    the slot's draft (:func:`next_age`), and ``behaviour_logprobs`` [R] float32, the log-probability of the path that
    produced each token (None: ``logprobs``; docs/design.md "Behaviour log-probs")."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    finish_reason: str
    version: int
    settings: SamplingSettings
    age: int = 0
    behaviour_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.token_ids.numel())

    @property
    def behaviour(self) -> torch.Tensor:
        """The behaviour log-probs [R] float32 (``logprobs`` where none were stored)."""
        return self.logprobs if self.behaviour_logprobs is None else self.behaviour_logprobs


def make_draft(
    token_ids: Sequence[int] | torch.Tensor,
    logprobs: Sequence[float] | torch.Tensor,
    finish_reason: str,
    version: int,
    settings: SamplingSettings,
    age: int = 0,
    behaviour_logprobs: Sequence[float] | torch.Tensor | None = None,
) -> Draft:
    """Validate a response and its log-probs (``behaviour_logprobs``: None, or as many as the tokens) and pack them as
    a :class:`Draft` (CPU copies). TypeError: non-integer ids (never rounded) or version, non-numeric log-probs,
    settings not a SamplingSettings. ValueError: not 1-D, length mismatch, unknown finish reason, NaN or positive
    log-probs, ids outside [0, 2**31), a negative version."""
    ids = as_id_vector("token_ids", token_ids)
    vectors = {"logprobs": logprobs, "behaviour_logprobs": behaviour_logprobs}
    lps = {name: as_float_vector(name, v) for name, v in vectors.items() if v is not None}
    for name, v in lps.items():
        if ids.numel() != v.numel():
            raise ValueError(f"token_ids ({ids.numel()}) and {name} ({v.numel()}) must have the same length")
        problem = logprob_problem(v)
        if problem:
            raise ValueError(f"{name} {problem}")
    check_choice("finish_reason", finish_reason, FINISH_REASONS)
    version = check_int("version", version, low=0, hint=" (the training step of the policy that validated the draft)")
    check_settings(settings)
    age = check_int("age", age, low=0)
    behaviour = lps.get("behaviour_logprobs")
    behaviour = None if behaviour is None else _own(behaviour.cpu().float(), lps["logprobs"].cpu().float())
    return Draft(
        ids.to(torch.int32).cpu().clone(),
        lps["logprobs"].cpu().clone(),
        finish_reason,
        version,
        settings,
        age,
        behaviour,
    )


def next_age(draft: Draft | None, verified_prefix_len: int) -> int:
    """The age of a response: its draft's + 1 when it kept a verified prefix of the draft, else 0 (a fresh sample)."""
    return draft.age + 1 if draft is not None and verified_prefix_len > 0 else 0


def check_key(key) -> CacheKey:
    """``key`` itself, or a TypeError when it is not a :class:`CacheKey`."""
    return check_type("key", key, CacheKey, "a CacheKey (CacheKey.make(prompt_ids, slot, dataset_id))")


class DraftStore(abc.ABC):
    """Lookup/store semantics of every draft store; subclasses implement ``_read(key)`` and ``_write(key, draft)``.
    Counters ``hits``, ``misses`` and ``settings_mismatches`` count this process's lookups. ``owner``: the policy the
    drafts belong to (:func:`~spec_rl.drafts.owner.policy_owner`; None until :meth:`claim`)."""

    _name = "draft store"
    _fix = "use the same temperature/top-k/top-p, or start from an empty store"

    def __init__(self) -> None:
        self._warned: set[tuple[SamplingSettings, SamplingSettings]] = set()
        self.hits = self.misses = self.settings_mismatches = 0
        self.owner: str | None = None

    def claim(self, owner: str, where: str | None = None) -> None:
        """Bind the store to the policy ``owner``; DraftOwnerError (a ValueError) when it holds another's drafts
        (``where`` names the store in the message)."""
        if not isinstance(owner, str) or not owner:
            raise TypeError(f"owner must be a non-empty str (policy_owner(tokenizer, config)), got {owner!r}")
        self.owner = merged_owner(self.owner, owner, where or f"this {self._name}")

    @abc.abstractmethod
    def _read(self, key: CacheKey) -> Draft | None: ...

    @abc.abstractmethod
    def _write(self, key: CacheKey, draft: Draft) -> None: ...

    def lookup(self, key: CacheKey, settings: SamplingSettings) -> Draft | None:
        """The draft of ``key`` as stored (cut it with :func:`~spec_rl.drafts.validity.draft_views` before reuse), or
        None. Another sampling distribution than ``settings``' is a miss, warned once per pair: log-probs of different
        distributions are not comparable. TypeError: ``key`` not a CacheKey, ``settings`` not a SamplingSettings."""
        check_settings(settings)
        draft = self._read(check_key(key))
        # The budget may differ (it changes no log-prob): draft_views cuts the draft to today's budget and EOS set.
        if draft is not None and not draft.settings.same_distribution(settings):
            self.settings_mismatches += 1
            pair = (draft.settings, settings)
            if pair not in self._warned:
                self._warned.add(pair)
                warnings.warn(
                    f"{self._name}: draft was sampled with {draft.settings} but the lookup asks for {settings}; "
                    f"treating it as a miss (log-probs of different sampling distributions are not comparable). "
                    f"To reuse drafts, {self._fix}.",
                    stacklevel=2,
                )
            draft = None
        if draft is None:
            self.misses += 1
            return None
        self.hits += 1
        return draft

    def store(
        self,
        key: CacheKey,
        token_ids: Sequence[int] | torch.Tensor,
        logprobs: Sequence[float] | torch.Tensor,
        finish_reason: str,
        version: int,
        settings: SamplingSettings,
        age: int = 0,
        behaviour_logprobs: Sequence[float] | torch.Tensor | None = None,
    ) -> None:
        """Insert or replace the draft of ``key``, validated as :func:`make_draft` does (TypeError: not a CacheKey)."""
        draft = make_draft(token_ids, logprobs, finish_reason, version, settings, age, behaviour_logprobs)
        self._write(check_key(key), draft)


class RolloutCache(DraftStore):
    """In-memory map from :class:`CacheKey` to :class:`Draft`, with atomic save/load."""

    _name = "rollout cache"
    _fix = "use the same temperature/top-k/top-p, or clear the cache"

    def __init__(self) -> None:
        super().__init__()
        self._entries: dict[bytes, Draft] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: CacheKey) -> bool:
        return key.digest in self._entries

    def drafts(self) -> list[Draft]:
        """Every stored draft (in insertion order)."""
        return list(self._entries.values())

    def _read(self, key: CacheKey) -> Draft | None:
        return self._entries.get(key.digest)

    def _write(self, key: CacheKey, draft: Draft) -> None:
        self._entries[key.digest] = draft

    def clear(self) -> None:
        self._entries.clear()

    def update(self, other: RolloutCache) -> None:
        """Insert (or replace) every draft of ``other``, e.g. one just loaded from disk."""
        check_type("other", other, RolloutCache)
        if self.owner is not None:
            other.claim(self.owner, "the cache merged in")
        self.owner = other.owner
        self._entries.update(other._entries)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the cache to ``path`` (a .safetensors file) atomically: an interrupted save leaves the old file."""
        digests, drafts = list(self._entries.keys()), list(self._entries.values())
        settings_list = list(dict.fromkeys(d.settings for d in drafts))  # distinct, in order of first use
        tensors = {
            "keys": torch.tensor(list(b"".join(digests)), dtype=torch.uint8).reshape(len(digests), _KEY_BYTES),
            "offsets": torch.tensor([0, *itertools.accumulate(len(d) for d in drafts)], dtype=torch.int64),
            "token_ids": torch.cat([d.token_ids for d in drafts]) if drafts else torch.zeros(0, dtype=torch.int32),
            "logprobs": torch.cat([d.logprobs for d in drafts]) if drafts else torch.zeros(0, dtype=torch.float32),
            "behaviour_logprobs": torch.cat([d.behaviour for d in drafts])
            if drafts
            else torch.zeros(0, dtype=torch.float32),
            "versions": torch.tensor([d.version for d in drafts], dtype=torch.int64),
            "ages": torch.tensor([d.age for d in drafts], dtype=torch.int64),
            "finish": torch.tensor([FINISH_REASONS.index(d.finish_reason) for d in drafts], dtype=torch.uint8),
            "settings_index": torch.tensor([settings_list.index(d.settings) for d in drafts], dtype=torch.int32),
        }
        metadata = {
            **_FORMAT,
            "settings": json.dumps([s.to_dict() for s in settings_list]),
            **({"owner": self.owner} if self.owner is not None else {}),
        }
        return atomic_save_safetensors(path, tensors, metadata)

    @classmethod
    def load(cls, path: str | os.PathLike, vocab_size: int | None = None) -> RolloutCache:
        """Read a cache written by :meth:`save`, checking all of it first; token ids must lie in [0, ``vocab_size``)
        when given, else in the int32 range. FileNotFoundError: no file; ValueError: not a spec-rl rollout cache, or
        damaged (one error naming the file and the problem); TypeError: a non-integer ``vocab_size``. The cache's
        ``owner`` is the policy recorded with it (check it with :meth:`claim`)."""
        check = open_stored(path, "rollout cache", _FORMAT, _FIX, vocab_size)
        stored_settings = check.json_field("settings", list, "a JSON list of sampling settings")
        settings_list = [check.settings(d, f"settings[{i}]") for i, d in enumerate(stored_settings)]
        keys = check.tensor("keys", torch.uint8, (None, _KEY_BYTES))
        n = keys.shape[0]
        offsets = check.tensor("offsets", torch.int64, (n + 1,))
        ids = check.tensor("token_ids", torch.int32, (None,))
        lps = check.tensor("logprobs", torch.float32, (ids.numel(),))
        # caches written before 0.6 have no behaviour log-probs: the stored log-probs stand for them
        behaviour = None
        if "behaviour_logprobs" in check.tensors:
            behaviour = check.tensor("behaviour_logprobs", torch.float32, (ids.numel(),))
        versions = check.tensor("versions", torch.int64, (n,))
        # caches written before 0.5 have no ages: their drafts count as fresh samples
        fresh = torch.zeros(n, dtype=torch.int64)
        age_t = check.tensor("ages", torch.int64, (n,)) if "ages" in check.tensors else fresh
        finish = check.tensor("finish", torch.uint8, (n,))
        settings_index = check.tensor("settings_index", torch.int32, (n,))
        check.offsets("offsets", offsets, ids.numel())
        check.token_ids("token_ids", ids)
        check.logprobs("logprobs", lps)
        if behaviour is not None:
            check.logprobs("behaviour_logprobs", behaviour)
        check.in_range("finish", finish, len(FINISH_REASONS))
        check.in_range("settings_index", settings_index, len(settings_list))
        check.non_negative("versions", versions)
        check.non_negative("ages", age_t)
        ages = age_t.tolist()
        digests = [bytes(k) for k in keys.tolist()]
        check.unique("keys", digests)
        lengths = offsets.diff().tolist()
        token_rows, logprob_rows = ids.split(lengths), lps.split(lengths)
        behaviour_rows = behaviour.split(lengths) if behaviour is not None else [None] * n
        rows = zip(digests, token_rows, logprob_rows, finish.tolist(), versions.tolist(), settings_index.tolist(), ages)
        cache = cls()
        cache.owner = check.meta.get("owner")
        cache._entries = {
            digest: Draft(t.clone(), lp.clone(), FINISH_REASONS[f], v, settings_list[s], a, _own(b, lp))
            for (digest, t, lp, f, v, s, a), b in zip(rows, behaviour_rows)
        }
        return cache


def _own(behaviour: torch.Tensor | None, logprobs: torch.Tensor) -> torch.Tensor | None:
    """A loaded draft's behaviour log-probs: a copy, or None where they equal its log-probs."""
    return None if behaviour is None or torch.equal(behaviour, logprobs) else behaviour.clone()
