"""A transformers KV-cache layer that appends in place: ``DynamicLayer`` copies the whole cache with ``torch.cat`` every
decode step; :class:`InPlaceLayer` writes into spare columns of a buffer that grows by half, with the same values."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from ..sampling.groups import RowContext

#: Spare columns a buffer gets at least when it is (re)allocated.
MIN_SPARE = 64


def buffer_columns(n: int, extra: int = 0, limit: int | None = None) -> int:
    """Columns for ``n`` columns now and ``extra`` soon, plus spare; at most ``limit`` unless ``n + extra`` need it."""
    size = n + max(extra, n // 2, MIN_SPARE)
    return size if limit is None else max(min(size, limit), n + extra)


class InPlaceLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys``/``values`` [B, H, n, D] are views of longer buffers; after ``crop`` the next
    update overwrites the cropped columns of views returned before. A buffer grows to at most ``max_columns`` columns
    (None: no limit) unless an update needs more."""

    max_columns: int | None = None

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, max_columns: int | None = None):
        super().__init__()
        self.device = keys.device
        self.is_initialized = True
        self.max_columns = max_columns
        self._adopt(keys, values, extra=0)

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, extra: int) -> None:
        b, h, n, d = keys.shape
        size = buffer_columns(n, extra, self.max_columns)
        self._key_buffer = keys.new_empty((b, h, size, d))
        self._value_buffer = values.new_empty((b, values.shape[1], size, values.shape[3]))
        self._key_buffer[:, :, :n].copy_(keys)
        self._value_buffer[:, :, :n].copy_(values)
        self._fill(n)

    @classmethod
    def owning(
        cls, key_buffer: torch.Tensor, value_buffer: torch.Tensor, n: int, max_columns: int | None = None
    ) -> InPlaceLayer:
        """A layer on buffers [B, H, size, D] (no copy) whose first ``n`` columns are the cache."""
        assert 0 <= n <= key_buffer.shape[-2] and key_buffer.shape[:2] == value_buffer.shape[:2]
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        layer.device, layer.is_initialized, layer.max_columns = key_buffer.device, True, max_columns
        layer._key_buffer, layer._value_buffer = key_buffer, value_buffer
        layer._fill(n)
        return layer

    def _fill(self, n: int) -> None:
        self.keys = self._key_buffer[:, :, :n]
        self.values = self._value_buffer[:, :, :n]

    def _owns_views(self) -> bool:
        return (
            self.keys.data_ptr() == self._key_buffer.data_ptr()
            and self.keys.shape[0] == self._key_buffer.shape[0]
            and self.values.data_ptr() == self._value_buffer.data_ptr()
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append [B, H, w, D] keys and values; returns the views of all n + w columns."""
        if not self.is_initialized or self.keys is None:  # after reset()
            self.device, self.is_initialized = key_states.device, True
            self._adopt(key_states[:, :, :0], value_states[:, :, :0], extra=key_states.shape[-2])
        n, w = self.keys.shape[-2], key_states.shape[-2]
        if not self._owns_views() or n + w > self._key_buffer.shape[-2]:
            self._adopt(self.keys, self.values, extra=w)
        self._key_buffer[:, :, n : n + w].copy_(key_states)
        self._value_buffer[:, :, n : n + w].copy_(value_states)
        self._fill(n + w)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() == 0:
            return
        n = self.keys.shape[-2]
        if not self._owns_views():
            self._adopt(self.keys, self.values, extra=0)
        self._key_buffer = self._key_buffer[indices]
        self._value_buffer = self._value_buffer[indices]
        self._fill(n)

    def drop_front(self, n: int) -> None:
        """Forget the first ``n`` columns (padding no row attends to) without a copy."""
        if not self._owns_views():
            self._adopt(self.keys, self.values, extra=0)
        kept = self.keys.shape[-2] - n
        self._key_buffer = self._key_buffer[:, :, n:]
        self._value_buffer = self._value_buffer[:, :, n:]
        self._fill(kept)


def left_padded_cache(rows: Sequence[RowContext], max_columns: int | None = None) -> tuple[DynamicCache, torch.Tensor]:
    """(cache of right-aligned rows, mask [B, W] int64); each row's layer is gathered once, when its buffers are
    filled; buffers of at most ``max_columns`` columns."""
    lengths = [r.length for r in rows]
    width, b = max(lengths), len(rows)
    like = rows[0].layers[0][0]  # [rows, H, T, D] of a pass: its shape, dtype and device
    pad = torch.tensor([width - n for n in lengths], device=like.device)
    mask = (torch.arange(width, device=like.device).unsqueeze(0) >= pad.unsqueeze(1)).long()
    shape = (b, like.shape[1], buffer_columns(width, limit=max_columns), like.shape[3])
    layers = []
    for layer in range(len(rows[0])):
        keys, values = like.new_empty(shape), like.new_empty(shape)
        for i, row in enumerate(rows):
            start = width - lengths[i]
            for buf, part in zip((keys, values), row[layer]):
                buf[i, :, :start].zero_()  # padding must be finite: a masked key still multiplies its value by 0
                buf[i, :, start:width].copy_(part)
        layers.append(InPlaceLayer.owning(keys, values, width, max_columns))
    return _cache_of(layers), mask


def in_place_cache(layers: Iterable[tuple[torch.Tensor, torch.Tensor]], max_columns: int | None = None) -> DynamicCache:
    """A ``DynamicCache`` of :class:`InPlaceLayer` s holding per-layer (keys, values) [B, H, n, D] (copied), buffers
    of at most ``max_columns`` columns. ``layers`` is read one at a time: fed by :func:`drain`, the source cache and
    the copy never coexist whole."""
    return _cache_of([InPlaceLayer(k, v, max_columns) for k, v in layers])


def drain(cache) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) of ``cache``, each layer taken out of it as it is read (``cache`` ends empty)."""
    while cache.layers:
        layer = cache.layers.pop(0)
        yield layer.keys, layer.values


def _cache_of(layers: list[InPlaceLayer]) -> DynamicCache:
    cache = DynamicCache()
    cache.layers[:] = layers
    return cache
