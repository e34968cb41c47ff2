"""A draft store shared by processes and nodes (verl's and OpenRLHF's Ray workers): one safetensors file per key,
``<root>/<2 hex digits>/<32 hex digits>.safetensors``. Writes rename a temporary with :func:`os.replace` (atomic, no
locks): readers see the old or the new file, concurrent writers leave one. An unreadable file is a miss, warned."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import warnings
from pathlib import Path

import torch

from ..util.atomic import atomic_save_safetensors, atomic_write_text, remove_leftovers
from .cache import CacheKey, Draft, DraftStore, make_draft
from .owner import merged_owner
from .stored_files import FileCheck

_MARKER = "SPEC_RL_DRAFT_STORE"
_FORMAT = {"format": "spec-rl-draft", "format_version": "1"}


class DirectoryDraftStore(DraftStore):
    """Drafts keyed by :class:`~spec_rl.drafts.cache.CacheKey`, one atomic file each, under ``root`` (created if
    missing; the same for every worker). ``fsync``: flush each file before the rename (durable across a machine
    crash; atomicity does not depend on it). ValueError when ``root`` is a file, or a non-empty directory that is not
    a draft store (so a typo cannot scatter files into an unrelated folder)."""

    _fix = "use the same temperature/top-k/top-p, or point the run at a new directory"

    def __init__(self, root: str | os.PathLike, fsync: bool = True) -> None:
        super().__init__()
        self.root = Path(root)
        self.fsync = bool(fsync)
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"draft store root {self.root} is a file; pass a directory")
        self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root / _MARKER
        if not marker.exists():
            if any(p.name != _MARKER and not p.name.startswith(".") for p in self.root.iterdir()):
                raise ValueError(
                    f"{self.root} is a non-empty directory that is not a spec-rl draft store; "
                    "pass an empty or new directory"
                )
            # Several workers may race to create the marker: any one of them is fine.
            with contextlib.suppress(FileExistsError), open(marker, "x") as f:
                f.write(json.dumps(_FORMAT) + "\n")

    def claim(self, owner: str, where: str | None = None) -> None:
        """Bind the directory to the policy ``owner`` (recorded in its marker file, for every worker);
        DraftOwnerError (a ValueError) when it holds another policy's drafts."""
        try:
            marker = json.loads((self.root / _MARKER).read_text() or "{}")
        except (OSError, ValueError):  # being created by another worker: no owner yet
            marker = {}
        merged_owner(marker.get("owner"), owner, where or f"draft directory {self.root}")
        super().claim(owner, where)
        if marker.get("owner") is None:
            marker = {**_FORMAT, **marker, "owner": owner}
            atomic_write_text(self.root / _MARKER, json.dumps(marker) + "\n")

    def path_for(self, key: CacheKey) -> Path:
        hexkey = key.digest.hex()
        return self.root / hexkey[:2] / f"{hexkey}.safetensors"

    def __contains__(self, key: CacheKey) -> bool:
        return self.path_for(key).is_file()

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob("??/*.safetensors"))

    def _read(self, key: CacheKey) -> Draft | None:
        from safetensors.torch import load

        path = self.path_for(key)
        try:
            # One read, so metadata and tensors come from one version even if a writer replaces the file meanwhile.
            data = path.read_bytes()
            (header_len,) = struct.unpack("<Q", data[:8])
            meta = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
            tensors = load(data)
        except FileNotFoundError:
            return None
        except Exception as exc:  # a damaged file (not a torn write: writes are atomic) is a miss, not a crash
            warnings.warn(f"draft store: cannot read {path} ({exc}); treating it as a miss", stacklevel=3)
            return None
        if {k: meta.get(k) for k in ("format", "format_version", "key")} != {**_FORMAT, "key": key.digest.hex()}:
            warnings.warn(f"draft store: {path} is not a draft of this key/format; treating it as a miss", stacklevel=3)
            return None
        check = FileCheck(path, meta, tensors, "treating it as a miss")
        try:  # checked as DraftStore.store checks a new draft
            ids = check.tensor("token_ids", torch.int32, (None,))
            lps = check.tensor("logprobs", torch.float32, (ids.numel(),))
            # files written before 0.6 have no behaviour log-probs: the stored log-probs stand for them
            behaviour = None
            if "behaviour_logprobs" in tensors:
                behaviour = check.tensor("behaviour_logprobs", torch.float32, (ids.numel(),))
            stored = check.json_field("settings", dict, "a JSON object of sampling settings")
            settings = check.settings(stored, "settings")
            age = check.count_field("age") if "age" in meta else 0  # files written before 0.5 have no age
            version = check.count_field("version")
            return make_draft(ids, lps, meta.get("finish_reason"), version, settings, age, behaviour)
        except (TypeError, ValueError) as exc:
            problem = getattr(exc, "problem", exc)  # a DamagedFileError's text without the path again
            warnings.warn(f"draft store: {path} is damaged ({problem}); treating it as a miss", stacklevel=3)
            return None

    def _write(self, key: CacheKey, draft: Draft) -> None:
        path = self.path_for(key)
        metadata = {
            **_FORMAT,
            "key": key.digest.hex(),
            "finish_reason": draft.finish_reason,
            "version": str(draft.version),
            "age": str(draft.age),
            "settings": json.dumps(draft.settings.to_dict(), sort_keys=True),
        }
        tensors = {"token_ids": draft.token_ids, "logprobs": draft.logprobs}
        if draft.behaviour_logprobs is not None:
            tensors["behaviour_logprobs"] = draft.behaviour_logprobs
        atomic_save_safetensors(path, tensors, metadata, fsync=self.fsync)

    def clear(self) -> None:
        """Delete every draft file and the temporaries of killed writers (the directory and its marker stay)."""
        for p in self.root.glob("??/*.safetensors"):
            p.unlink(missing_ok=True)
        for folder in self.root.glob("??"):
            remove_leftovers(folder)
