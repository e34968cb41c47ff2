"""Rollout cache: last epoch's response per (prompt, sample slot), used as the draft.

Keys are the prompt's token ids (plus an optional dataset id) and the sample
slot within the group, hashed with BLAKE2b. Text is never used as a key, so
two prompts that decode to the same string but tokenise differently never
collide, and shuffling the data between epochs changes nothing. (The SPEC-RL
reference implementation keys by decoded prompt text and needs unshuffled
data; docs/design.md "Facts from the field".)

Each entry stores the response token ids (int32), their log-probs (float32)
under the policy that last validated them, the finish reason, the policy
version (training step) and the sampling settings. A lookup under different
sampling settings is a miss (with one warning per distinct pair of
settings): comparing log-probs of different distributions would silently
destroy reuse (docs/design.md "The rule", step 1).

On disk the cache is one safetensors file, written to a temporary file in
the same folder, fsynced and renamed over the old one, so a crash mid-write
leaves the previous file intact. Everything is checked twice: a draft when it is
stored (a float id is refused, never rounded) and the whole file when it is
loaded (a damaged file is one ValueError naming the file and the problem).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..sampling.distribution import SamplingSettings, check_settings
from ..util.atomic import atomic_save_safetensors
from ..util.validation import INT64_MAX, as_float_vector, as_id_vector, check_int, logprob_problem
from .stored_files import FileCheck, read_safetensors

FINISH_REASONS = ("eos", "length")
_FORMAT = "spec-rl-rollout-cache"
_FORMAT_VERSION = "1"
_KEY_BYTES = 16
_FIX = "delete the file or restore a backup (without a cache the next epoch generates every response afresh)"


@dataclass(frozen=True)
class CacheKey:
    """Identity of one draft: hash of (dataset id, sample slot, prompt token ids).

    ``uid`` (63-bit, from the hash) keys the acceptance uniforms of this
    sample, so its random decisions are independent of batch position.
    """

    digest: bytes

    @property
    def uid(self) -> int:
        return int.from_bytes(self.digest[:8], "little") & ((1 << 63) - 1)

    @classmethod
    def make(cls, prompt_ids: Sequence[int] | torch.Tensor, slot: int, dataset_id: str | None = None) -> CacheKey:
        """Build a key.

        Args:
            prompt_ids: the prompt's token ids (list, numpy array or 1-D integer tensor), each in [0, 2**63).
            slot: sample index within the group, 0 <= slot.
            dataset_id: optional stable id of the dataset row (e.g. "gsm8k:17").

        Raises:
            TypeError: ids that are not integers (floats are never rounded), a non-integer slot, a
                dataset id that is not a str.
            ValueError: ids not 1-D or out of range, a negative slot.
        """
        ids = as_id_vector("prompt_ids", prompt_ids, high=INT64_MAX)
        slot = check_int("slot", slot, low=0, high=INT64_MAX, hint=" (the sample's index within its group)")
        if dataset_id is not None and not isinstance(dataset_id, str):
            raise TypeError(
                f"dataset_id must be a str or None, got {type(dataset_id).__name__} {dataset_id!r} "
                f'(e.g. dataset_id="gsm8k:{dataset_id}")'
            )
        h = hashlib.blake2b(digest_size=_KEY_BYTES, person=b"spec-rl-cache-1")
        h.update((dataset_id if dataset_id is not None else "\x00none").encode("utf-8"))
        h.update(b"\xff")
        h.update(slot.to_bytes(8, "little", signed=False))
        h.update(ids.cpu().contiguous().numpy().tobytes())  # int64 little-endian, as keys always were
        return cls(h.digest())


@dataclass
class Draft:
    """One cached response.

    Attributes:
        token_ids: [R] int32 response token ids (EOS included when it ended with EOS).
        logprobs: [R] float32 sampling log-probs under the policy of ``version``.
        finish_reason: "eos" or "length".
        version: training step of the policy that last validated the tokens.
        settings: sampling settings the response was drawn with.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    finish_reason: str
    version: int
    settings: SamplingSettings

    def __len__(self) -> int:
        return int(self.token_ids.numel())


def make_draft(
    token_ids: Sequence[int] | torch.Tensor,
    logprobs: Sequence[float] | torch.Tensor,
    finish_reason: str,
    version: int,
    settings: SamplingSettings,
) -> Draft:
    """Validate a response and its log-probs and pack them as a :class:`Draft` (CPU copies).

    Raises:
        TypeError: ids that are not integers (floats are never rounded, bools are not ids), log-probs
            that are not numbers, a non-integer version, settings that are not a SamplingSettings.
        ValueError: ids or log-probs not 1-D, length mismatch, unknown finish reason, NaN or positive
            logprobs, token ids outside [0, 2**31), a negative version.
    """
    ids = as_id_vector("token_ids", token_ids)
    lps = as_float_vector("logprobs", logprobs)
    if ids.numel() != lps.numel():
        raise ValueError(f"token_ids ({ids.numel()}) and logprobs ({lps.numel()}) must have the same length")
    if not isinstance(finish_reason, str) or finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
    problem = logprob_problem(lps)
    if problem:
        raise ValueError(f"logprobs {problem}")
    version = check_int("version", version, low=0, hint=" (the training step of the policy that validated the draft)")
    check_settings(settings)
    return Draft(
        token_ids=ids.to(torch.int32).cpu().clone(),
        logprobs=lps.cpu().clone(),
        finish_reason=finish_reason,
        version=version,
        settings=settings,
    )


def draft_fits(draft: Draft, settings: SamplingSettings) -> bool:
    """Whether ``draft`` can be scored under ``settings``: it was sampled from the same distribution.

    The budget (``max_tokens``) changes no token's log-prob, only where a response ends, so a draft
    recorded under another budget is still looked up; what part of it is valid under today's budget
    and EOS set, and whether it is a whole response or a prefix to continue, is decided where it is
    reused (:mod:`spec_rl.drafts.validity`).
    """
    return draft.settings.same_distribution(settings)


def check_key(key) -> CacheKey:
    """``key`` itself, or a TypeError when it is not a :class:`CacheKey`."""
    if not isinstance(key, CacheKey):
        raise TypeError(
            f"key must be a CacheKey (CacheKey.make(prompt_ids, slot, dataset_id)), got {type(key).__name__}"
        )
    return key


class DraftStore:
    """Lookup/store semantics shared by every draft store (in memory, on a shared filesystem).

    Subclasses implement ``_read(key) -> Draft | None`` and ``_write(key, draft)``.
    A lookup under other sampling settings than the draft's is a miss, with one
    warning per distinct pair: log-probs of different sampling distributions are not
    comparable (docs/design.md "The rule", step 1), and reusing them would silently destroy reuse.
    Counters ``hits``, ``misses`` and ``settings_mismatches`` count this process's lookups.
    """

    _name = "draft store"
    _fix = "use the same temperature/top-k/top-p, or start from an empty store"

    def __init__(self) -> None:
        self._warned: set[tuple[SamplingSettings, SamplingSettings]] = set()
        self.hits = 0
        self.misses = 0
        self.settings_mismatches = 0

    def _read(self, key: CacheKey) -> Draft | None:
        raise NotImplementedError

    def _write(self, key: CacheKey, draft: Draft) -> None:
        raise NotImplementedError

    def lookup(self, key: CacheKey, settings: SamplingSettings) -> Draft | None:
        """Return the draft for ``key`` if it was sampled from the distribution of ``settings``, else None.

        The draft comes back as stored: cut it to today's budget and EOS set before reusing it
        (:func:`spec_rl.drafts.validity.draft_views`).

        Raises:
            TypeError: ``key`` is not a CacheKey or ``settings`` not a SamplingSettings.
        """
        check_settings(settings)
        draft = self._read(check_key(key))
        if draft is None:
            self.misses += 1
            return None
        if not draft_fits(draft, settings):
            self.misses += 1
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
    ) -> None:
        """Insert or replace the draft for ``key`` (validated here, so nothing bad reaches a file).

        Raises:
            TypeError, ValueError: see :func:`make_draft`; TypeError for a ``key`` that is not a CacheKey.
        """
        self._write(check_key(key), make_draft(token_ids, logprobs, finish_reason, version, settings))


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
        if not isinstance(other, RolloutCache):
            raise TypeError(f"other must be a RolloutCache, got {type(other).__name__}")
        self._entries.update(other._entries)

    # ------------------------------------------------------------------ disk
    def save(self, path: str | os.PathLike) -> Path:
        """Write the cache to ``path`` (a .safetensors file) atomically.

        The data go to a temporary file in the same folder, which is fsynced
        and then renamed over ``path``; an interrupted save leaves any earlier
        file untouched.
        """
        digests = list(self._entries.keys())
        drafts = [self._entries[d] for d in digests]
        settings_list: list[SamplingSettings] = []
        settings_index: list[int] = []
        for d in drafts:
            if d.settings not in settings_list:
                settings_list.append(d.settings)
            settings_index.append(settings_list.index(d.settings))
        lengths = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
        offsets = torch.zeros(len(drafts) + 1, dtype=torch.int64)
        if drafts:
            offsets[1:] = torch.cumsum(lengths, 0)
        tensors = {
            "keys": torch.tensor(list(b"".join(digests)), dtype=torch.uint8).reshape(len(digests), _KEY_BYTES),
            "offsets": offsets,
            "token_ids": torch.cat([d.token_ids for d in drafts]) if drafts else torch.zeros(0, dtype=torch.int32),
            "logprobs": torch.cat([d.logprobs for d in drafts]) if drafts else torch.zeros(0, dtype=torch.float32),
            "versions": torch.tensor([d.version for d in drafts], dtype=torch.int64),
            "finish": torch.tensor([FINISH_REASONS.index(d.finish_reason) for d in drafts], dtype=torch.uint8),
            "settings_index": torch.tensor(settings_index, dtype=torch.int32),
        }
        metadata = {
            "format": _FORMAT,
            "format_version": _FORMAT_VERSION,
            "settings": json.dumps([s.to_dict() for s in settings_list]),
        }
        return atomic_save_safetensors(path, tensors, metadata)

    @classmethod
    def load(cls, path: str | os.PathLike, vocab_size: int | None = None) -> RolloutCache:
        """Read a cache written by :meth:`save`, checking everything in it first.

        Args:
            path: the .safetensors file.
            vocab_size: when given, every stored token id must lie in [0, vocab_size) (without it:
                in the int32 range).

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file is not a spec-rl rollout cache, or is damaged: one error naming the
                file and what is wrong (a missing or mistyped tensor or metadata field, settings that
                are not valid JSON, offsets that do not rise from 0 to the token count, NaN or positive
                log-probs, ids out of range, indices past their tables, a key stored twice).
            TypeError: ``vocab_size`` is not an integer.
        """
        if vocab_size is not None:
            vocab_size = check_int("vocab_size", vocab_size, low=1)
        cache = cls()
        cache._entries = _read_cache_file(path, vocab_size)
        return cache


def _read_cache_file(path: str | os.PathLike, vocab_size: int | None) -> dict[bytes, Draft]:
    """The drafts of a cache file by key digest, after checking every tensor and field of it."""
    path, meta, tensors = read_safetensors(path, "rollout cache")
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{path} is not a spec-rl rollout cache (format={meta.get('format')!r})")
    if meta.get("format_version") != _FORMAT_VERSION:
        raise ValueError(f"{path} has cache format version {meta.get('format_version')!r}; expected {_FORMAT_VERSION}")
    check = FileCheck(path, meta, tensors, _FIX)
    stored_settings = check.json_field("settings", list, "a JSON list of sampling settings")
    settings_list = [check.settings(d, f"settings[{i}]") for i, d in enumerate(stored_settings)]
    keys = check.tensor("keys", torch.uint8, (None, _KEY_BYTES))
    n = keys.shape[0]
    offsets = check.tensor("offsets", torch.int64, (n + 1,))
    ids = check.tensor("token_ids", torch.int32, (None,))
    lps = check.tensor("logprobs", torch.float32, (ids.numel(),))
    versions = check.tensor("versions", torch.int64, (n,))
    finish = check.tensor("finish", torch.uint8, (n,))
    settings_index = check.tensor("settings_index", torch.int32, (n,))
    check.offsets("offsets", offsets, ids.numel())
    check.token_ids("token_ids", ids, vocab_size)
    check.logprobs("logprobs", lps)
    check.in_range("finish", finish, len(FINISH_REASONS))
    check.in_range("settings_index", settings_index, len(settings_list))
    check.non_negative("versions", versions)
    digests = [bytes(k) for k in keys.tolist()]
    check.unique("keys", digests)
    bounds = offsets.tolist()
    rows = zip(digests, versions.tolist(), finish.tolist(), settings_index.tolist())
    return {
        digest: Draft(
            token_ids=ids[bounds[i] : bounds[i + 1]].clone(),
            logprobs=lps[bounds[i] : bounds[i + 1]].clone(),
            finish_reason=FINISH_REASONS[f],
            version=v,
            settings=settings_list[si],
        )
        for i, (digest, v, f, si) in enumerate(rows)
    }
