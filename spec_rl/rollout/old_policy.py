"""The policies that produced live drafts, for the residual draw at a rejection (docs/design.md "The residual draw").

At l = 1 a draft token y_i ~ q is accepted with probability min(1, p(y_i)/q(y_i)); drawing the token at a rejection
from max(0, p - q) makes every position distributed as p (speculative sampling). A draft stores q(y_i) only, and the
rejection position is known only at verification, so q's whole distribution there is recomputed: every training step
whose responses are still drafts keeps a CPU copy of its weights, and each rejected draft costs one forward of
[prompt, y_<n] under its own step's weights. That is exact whatever the sampling settings; a top-k of q stored at
sampling time would be exact only under top-k sampling."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

import torch

#: Rows of one old-policy forward.
_CHUNK = 32


class PolicyVersions:
    """CPU copies of the policy's weights per version (the training step whose rollout used them); ``model`` is the
    policy being trained, ``pad_id`` its pad token. Keep a version before the step's update (:meth:`keep`) and drop
    the versions no draft names (:meth:`retain`)."""

    def __init__(self, model: torch.nn.Module, pad_id: int):
        self.model, self.pad_id = model, int(pad_id)
        self._weights: dict[int, dict[str, torch.Tensor]] = {}
        self._scratch: torch.nn.Module | None = None
        self._loaded: int | None = None

    def __contains__(self, version: int) -> bool:
        return version in self._weights

    def __len__(self) -> int:
        return len(self._weights)

    def keep(self, version: int) -> None:
        """Copy the policy's weights now as ``version``."""
        self._weights[int(version)] = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        if self._loaded == version:
            self._loaded = None

    def retain(self, versions: Iterable[int]) -> None:
        """Drop every version not in ``versions``."""
        keep = set(versions)
        self._weights = {v: w for v, w in self._weights.items() if v in keep}

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
            self._scratch.load_state_dict(self._weights[version])
            self._loaded = version
        return self._scratch


def _last_logits(model, contexts: Sequence[Sequence[int]], pad_id: int, device) -> torch.Tensor:
    """Logits [N, V] at each right-padded context's last position."""
    lengths = [len(c) for c in contexts]
    ids = torch.full((len(contexts), max(lengths)), pad_id, dtype=torch.long)
    for row, c in enumerate(contexts):
        ids[row, : len(c)] = torch.tensor(c, dtype=torch.long)
    mask = (torch.arange(ids.shape[1]).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    return logits[torch.arange(len(contexts), device=device), torch.tensor(lengths, device=device) - 1]
