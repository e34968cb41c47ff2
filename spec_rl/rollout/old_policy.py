"""The policies that produced live drafts, for the residual draw at a rejection (docs/design.md "The residual draw").

At l = 1 a draft token y_i ~ q is accepted with probability min(1, p(y_i)/q(y_i)); drawing the token at a rejection
from max(0, p - q) makes every position distributed as p (speculative sampling). A draft stores q(y_i) only, and the
rejection position is known only at verification, so q's whole distribution there is recomputed: every training step
whose responses are still drafts keeps a copy of its weights (in the model's dtype, in CPU memory or as a safetensors
file read memory-mapped), and each rejected draft costs one forward of [prompt, y_<n] under its own step's weights.
That is exact whatever the sampling settings; a top-k of q stored at sampling time would be exact only under top-k
sampling. A shuffled epoch frees a step's copy only once all its prompts were rolled again, so the copies peak at
1.5-2x an epoch's steps: :func:`peak_copies` gives the exact number for a run's orders, checked before it trains.
The coupled keys (:mod:`spec_rl.acceptance.rules.coupled`) give an exact sample of the current policy without copies."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ..util.atomic import atomic_save_safetensors

#: Rows of one old-policy forward.
_CHUNK = 32


class PolicyVersions:
    """Copies of the policy's weights per version (the training step whose rollout used them); ``model`` is the policy
    being trained, ``pad_id`` its pad token. ``folder``: keep each version as a safetensors file there (read
    memory-mapped when needed; None: in CPU memory). ``max_copies``: the most versions held at once (None: no bound);
    one more raises RuntimeError, before memory or disk runs out. Keep a version before the step's update
    (:meth:`keep`) and drop the versions no draft names (:meth:`retain`)."""

    def __init__(self, model: torch.nn.Module, pad_id: int, folder: str | os.PathLike | None = None, max_copies=None):
        self.model, self.pad_id = model, int(pad_id)
        self.folder = None if folder is None else Path(folder)
        self.max_copies = max_copies
        self._weights: dict[int, dict[str, torch.Tensor] | Path] = {}
        self._scratch: torch.nn.Module | None = None
        self._loaded: int | None = None
        if self.folder is not None:  # files of an earlier process name versions this one never kept
            self.folder.mkdir(parents=True, exist_ok=True)
            for stale in self.folder.glob("*.safetensors*"):
                stale.unlink()

    def __contains__(self, version: int) -> bool:
        return version in self._weights

    def __len__(self) -> int:
        return len(self._weights)

    def keep(self, version: int) -> None:
        """Copy the policy's weights now as ``version``; RuntimeError past ``max_copies``."""
        version = int(version)
        if self.max_copies is not None and version not in self._weights and len(self) >= self.max_copies:
            raise RuntimeError(
                f"the residual draw would hold {len(self) + 1} weight copies, past the bound of {self.max_copies} "
                "checked before training (spec_rl.rollout.old_policy.peak_copies); this is a bug, please report it"
            )
        weights = shared_state_dict(self.model, copy=self.folder is None)
        if self.folder is not None:
            path = self.folder / f"{version}.safetensors"
            unique, aliases = _unique(weights)
            atomic_save_safetensors(path, unique, {"aliases": json.dumps(aliases)}, fsync=False)
            weights = path
        self._weights[version] = weights
        if self._loaded == version:
            self._loaded = None

    def retain(self, versions: Iterable[int]) -> None:
        """Drop every version not in ``versions`` (its file too)."""
        keep = set(versions)
        for version in [v for v in self._weights if v not in keep]:
            stored = self._weights.pop(version)
            if isinstance(stored, Path):
                stored.unlink(missing_ok=True)

    @torch.no_grad()
    def next_token_logits(self, versions: Sequence[int], contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits [N, V] float32 of the token after each context under its version's weights (on the model's device)."""
        device = next(self.model.parameters()).device
        out: torch.Tensor | None = None
        for version in sorted(set(versions)):
            rows = [i for i, v in enumerate(versions) if v == version]
            model = self._policy(version)
            for start in range(0, len(rows), _CHUNK):
                chunk = rows[start : start + _CHUNK]
                logits = _last_logits(model, [contexts[i] for i in chunk], self.pad_id, device)
                if out is None:
                    out = torch.empty((len(contexts), logits.shape[-1]), dtype=torch.float32, device=device)
                out[chunk] = logits.float()
        assert out is not None, "no contexts"
        return out

    def _policy(self, version: int) -> torch.nn.Module:
        if self._scratch is None:
            self._scratch = copy.deepcopy(self.model).eval().requires_grad_(False)
        if self._loaded != version:
            stored = self._weights[version]
            self._scratch.load_state_dict(_load(stored) if isinstance(stored, Path) else stored)
            self._loaded = version
        return self._scratch


def shared_state_dict(model: torch.nn.Module, copy: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict on the CPU, each storage once: tied weights (an LM head sharing the embedding) stay one
    tensor under both names; ``copy``: detached copies, not views of the live weights."""
    seen: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in seen:
            seen[key] = t.detach().to("cpu", copy=True) if copy else t.detach().cpu()
        out[name] = seen[key]
    return out


def copy_bytes(model: torch.nn.Module) -> int:
    """Bytes of one weight copy of ``model`` (tied weights once)."""
    tensors = _unique(shared_state_dict(model, copy=False))[0].values()
    return sum(t.numel() * t.element_size() for t in tensors)


def _unique(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors stored once, {alias name: stored name}) of a state dict whose tied names share a tensor."""
    first: dict[int, str] = {}
    unique, aliases = {}, {}
    for name, t in weights.items():
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
            unique[name] = t.contiguous()
    return unique, aliases


def _load(path: Path) -> dict[str, torch.Tensor]:
    """A version file's state dict, its tensors memory-mapped, tied names restored."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        out = {name: f.get_tensor(name) for name in f.keys()}
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    out.update({alias: out[name] for alias, name in aliases.items()})
    return out


def peak_copies(orders: Sequence[Sequence[int]], prompts_per_step: int) -> int:
    """The most weight copies :class:`PolicyVersions` holds at once when the trainer rolls its prompts in ``orders``
    (one list of prompt indices per epoch still to train), ``prompts_per_step`` at a time: each step keeps its copy
    (the last epoch's steps keep none: no later epoch reads their drafts) until no prompt's draft names it, plus the
    scratch model the old-policy forward runs in."""
    latest: dict[int, int] = {}  # prompt -> the step its draft came from
    named: dict[int, int] = {}  # step -> prompts whose draft came from it
    held: set[int] = set()
    peak, step = 0, 0
    for epoch, order in enumerate(orders):
        last_epoch = epoch == len(orders) - 1
        for start in range(0, len(order), prompts_per_step):
            if not last_epoch:
                held.add(step)
            peak = max(peak, len(held))
            named[step] = 0
            for i in order[start : start + prompts_per_step]:
                before = latest.get(i)
                if before is not None:
                    named[before] -= 1
                    if not named[before]:
                        held.discard(before)
                latest[i] = step
                named[step] += 1
            step += 1
    return peak + 1 if peak else 0


def _last_logits(model, contexts: Sequence[Sequence[int]], pad_id: int, device) -> torch.Tensor:
    """Logits [N, V] at each right-padded context's last position."""
    lengths = [len(c) for c in contexts]
    ids = torch.full((len(contexts), max(lengths)), pad_id, dtype=torch.long)
    for row, c in enumerate(contexts):
        ids[row, : len(c)] = torch.tensor(c, dtype=torch.long)
    mask = (torch.arange(ids.shape[1]).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    return logits[torch.arange(len(contexts), device=device), torch.tensor(lengths, device=device) - 1]
