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
leaves the previous file intact.
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

from .atomic import atomic_save_safetensors
from .sampling import SamplingSettings

FINISH_REASONS = ("eos", "length")
_FORMAT = "spec-rl-rollout-cache"
_FORMAT_VERSION = "1"
_KEY_BYTES = 16


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
    def make(cls, prompt_ids: Sequence[int] | torch.Tensor, slot: int, dataset_id: str | None = None) -> "CacheKey":
        """Build a key.

        Args:
            prompt_ids: the prompt's token ids (list or 1-D integer tensor).
            slot: sample index within the group, 0 <= slot.
            dataset_id: optional stable id of the dataset row (e.g. "gsm8k:17").
        """
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() != 1 or prompt_ids.is_floating_point():
                raise ValueError("prompt_ids must be a 1-D integer tensor or a list of ints")
            ids = [int(x) for x in prompt_ids.tolist()]
        else:
            ids = [int(x) for x in prompt_ids]
        if int(slot) != slot or slot < 0:
            raise ValueError(f"slot must be an integer >= 0 (the sample's index within its group), got {slot!r}")
        h = hashlib.blake2b(digest_size=_KEY_BYTES, person=b"spec-rl-cache-1")
        h.update((dataset_id if dataset_id is not None else "\x00none").encode("utf-8"))
        h.update(b"\xff")
        h.update(int(slot).to_bytes(8, "little", signed=False))
        h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
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
        ValueError: length mismatch, unknown finish reason, NaN or positive logprobs,
            token ids outside int32.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
    lps = torch.as_tensor(logprobs, dtype=torch.float32).reshape(-1)
    if ids.numel() != lps.numel():
        raise ValueError(f"token_ids ({ids.numel()}) and logprobs ({lps.numel()}) must have the same length")
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
    if bool(torch.isnan(lps).any()) or bool((lps > 1e-4).any()):
        raise ValueError("logprobs must be log-probabilities (<= 0, not NaN)")
    if bool((ids < 0).any()) or bool((ids > torch.iinfo(torch.int32).max).any()):
        raise ValueError("token_ids must be non-negative int32 values")
    return Draft(
        token_ids=ids.to(torch.int32).cpu().clone(),
        logprobs=lps.cpu().clone(),
        finish_reason=finish_reason,
        version=int(version),
        settings=settings,
    )


class DraftStore:
    """Lookup/store semantics shared by every draft store (in memory, on a shared filesystem).

    Subclasses implement ``_read(key) -> Draft | None`` and ``_write(key, draft)``.
    A lookup under other sampling settings than the draft's is a miss, with one
    warning per distinct pair: log-probs of different sampling distributions are not
    comparable (docs/design.md "The rule", step 1), and reusing them would silently destroy reuse.
    Counters ``hits``, ``misses`` and ``settings_mismatches`` count this process's lookups.
    """

    _name = "draft store"
    _fix = "use the same temperature/top-k/top-p/max_tokens, or start from an empty store"

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
        """Return the draft for ``key`` if it was sampled with ``settings``, else None."""
        draft = self._read(key)
        if draft is None:
            self.misses += 1
            return None
        if draft.settings != settings:
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
        """Insert or replace the draft for ``key``.

        Raises:
            ValueError: see :func:`make_draft`.
        """
        self._write(key, make_draft(token_ids, logprobs, finish_reason, version, settings))


class RolloutCache(DraftStore):
    """In-memory map from :class:`CacheKey` to :class:`Draft`, with atomic save/load."""

    _name = "rollout cache"
    _fix = "use the same temperature/top-k/top-p/max_tokens, or clear the cache"

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

    def update(self, other: "RolloutCache") -> None:
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
    def load(cls, path: str | os.PathLike) -> "RolloutCache":
        """Read a cache written by :meth:`save`.

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file is not a spec-rl rollout cache or is inconsistent.
        """
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no rollout cache at {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(f"{path} is not a readable safetensors file: {exc}") from exc
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a spec-rl rollout cache (format={meta.get('format')!r})")
        if meta.get("format_version") != _FORMAT_VERSION:
            raise ValueError(f"{path} has cache format version {meta.get('format_version')!r}; expected {_FORMAT_VERSION}")
        settings_list = [SamplingSettings(**d) for d in json.loads(meta["settings"])]
        keys, offsets = tensors["keys"], tensors["offsets"]
        n = keys.shape[0]
        if offsets.numel() != n + 1 or int(offsets[-1]) != tensors["token_ids"].numel():
            raise ValueError(f"{path}: offsets do not match the stored tokens (corrupt file)")
        cache = cls()
        for i in range(n):
            a, b = int(offsets[i]), int(offsets[i + 1])
            cache._entries[bytes(keys[i].tolist())] = Draft(
                token_ids=tensors["token_ids"][a:b].clone(),
                logprobs=tensors["logprobs"][a:b].clone(),
                finish_reason=FINISH_REASONS[int(tensors["finish"][i])],
                version=int(tensors["versions"][i]),
                settings=settings_list[int(tensors["settings_index"][i])],
            )
        return cache
