"""A transformers KV-cache layer that appends in place instead of concatenating.

transformers' ``DynamicLayer.update`` appends a decode step's keys and values with ``torch.cat``, which copies
the whole cache every step: O(width) bytes per step, O(width^2) per response. On the demo's decode batch
(256 rows, ~150 cached positions, 2 CPU cores) that copy was 55% of a decode step (torch profiler,
``aten::cat``). :class:`InPlaceLayer` keeps each layer's keys and values in a buffer with spare columns;
``update`` writes the new columns into the spare ones and returns views of the filled part, so a step
copies only what it adds. The buffer grows by half its size when full (amortised O(1) copies per
column, as a vector grows). Values are bitwise those of the ``torch.cat`` path: the same numbers at the
same positions, only stored in a longer buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["InPlaceLayer", "buffer_columns", "in_place_cache", "left_padded_cache"]

#: Spare columns a buffer gets at least when it is (re)allocated.
MIN_SPARE = 64


def buffer_columns(n: int, extra: int = 0) -> int:
    """Columns of a buffer that holds ``n`` columns now and ``extra`` more soon (plus spare: grows by half)."""
    return n + max(extra, n // 2, MIN_SPARE)


class InPlaceLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys``/``values`` [B, H, n, D] are views of longer buffers.

    Everything that reads ``keys``/``values`` (attention, :class:`~spec_rl.backends.hf_decode.KVRows`)
    sees the same values as with ``DynamicLayer``; a method of the base class that replaces them
    (``reorder_cache``, ``batch_repeat_interleave``) is noticed by :meth:`update`, which then copies
    them into a fresh buffer, and after ``reset`` the next update starts a new buffer. One difference:
    the tensors returned are views, so after ``crop`` the next update overwrites the cropped columns
    of views returned before it (``DynamicLayer`` returns fresh tensors); nothing in spec-rl keeps them.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.device = keys.device
        self.is_initialized = True
        self._adopt(keys, values, extra=0)

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, extra: int) -> None:
        """Copy ``keys``/``values`` into new buffers with room for ``extra`` more columns (and some spare)."""
        b, h, n, d = keys.shape
        size = buffer_columns(n, extra)
        self._key_buffer = keys.new_empty((b, h, size, d))
        self._value_buffer = values.new_empty((b, values.shape[1], size, values.shape[3]))
        self._key_buffer[:, :, :n].copy_(keys)
        self._value_buffer[:, :, :n].copy_(values)
        self._fill(n)

    @classmethod
    def owning(cls, key_buffer: torch.Tensor, value_buffer: torch.Tensor, n: int) -> InPlaceLayer:
        """A layer that takes ``key_buffer``/``value_buffer`` [B, H, size, D] as its buffers, no copy; their first
        ``n`` columns are the cache (the caller filled them)."""
        if not 0 <= n <= key_buffer.shape[-2] or key_buffer.shape[:2] != value_buffer.shape[:2]:
            raise ValueError(f"buffers {tuple(key_buffer.shape)} / {tuple(value_buffer.shape)} cannot hold {n} columns")
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        layer.device, layer.is_initialized = key_buffer.device, True
        layer._key_buffer, layer._value_buffer = key_buffer, value_buffer
        layer._fill(n)
        return layer

    def _fill(self, n: int) -> None:
        self.keys = self._key_buffer[:, :, :n]
        self.values = self._value_buffer[:, :, :n]

    def _owns_views(self) -> bool:
        """Whether ``keys``/``values`` still are views of the buffers (a base-class method may have replaced them)."""
        return (
            self.keys.data_ptr() == self._key_buffer.data_ptr()
            and self.keys.shape[0] == self._key_buffer.shape[0]
            and self.values.data_ptr() == self._value_buffer.data_ptr()
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append [B, H, w, D] keys and values; returns the views of all n + w columns."""
        if not self.is_initialized or self.keys is None:  # after reset(): start again from these columns
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
        """Keep the rows ``indices`` (one gather of the buffers, spare columns included); like ``DynamicLayer``,
        an empty layer is left as it is."""
        if self.get_seq_length() == 0:
            return
        n = self.keys.shape[-2]
        if not self._owns_views():
            self._adopt(self.keys, self.values, extra=0)
        self._key_buffer = self._key_buffer[indices]
        self._value_buffer = self._value_buffer[indices]
        self._fill(n)

    def drop_front(self, n: int) -> None:
        """Forget the first ``n`` columns (padding no row attends to): a view of the buffers, no copy."""
        if not self._owns_views():
            self._adopt(self.keys, self.values, extra=0)
        kept = self.keys.shape[-2] - n
        self._key_buffer = self._key_buffer[:, :, n:]
        self._value_buffer = self._value_buffer[:, :, n:]
        self._fill(kept)


def left_padded_cache(rows: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]) -> tuple[DynamicCache, torch.Tensor]:
    """A cache of :class:`InPlaceLayer` s holding each row's keys/values right-aligned (left padding is zero),
    and its attention mask [B, W] int64 (1 = a real column). ``rows[b][layer]`` is (keys, values) [H, L_b, D].

    Each row is copied once, straight into the buffers the decode steps append to (building a padded
    batch first and copying it into the buffers copied every K/V twice).
    """
    lengths = [int(r[0][0].shape[1]) for r in rows]
    width, b = max(lengths), len(rows)
    device = rows[0][0][0].device
    pad = torch.tensor([width - n for n in lengths], device=device)
    mask = (torch.arange(width, device=device).unsqueeze(0) >= pad.unsqueeze(1)).long()
    layers = []
    for layer in range(len(rows[0])):
        buffers = []
        for part in (0, 1):  # keys, values
            first = rows[0][layer][part]
            buf = first.new_empty((b, first.shape[0], buffer_columns(width), first.shape[2]))
            for i, row in enumerate(rows):
                start = width - lengths[i]
                buf[i, :, :start].zero_()  # padding must be finite: a masked key still multiplies its value by 0
                buf[i, :, start:width].copy_(row[layer][part])
            buffers.append(buf)
        layers.append(InPlaceLayer.owning(buffers[0], buffers[1], width))
    return _cache_of(layers), mask


def in_place_cache(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A ``DynamicCache`` holding per-layer (keys, values) [B, H, n, D] in :class:`InPlaceLayer` s (copied)."""
    return _cache_of([InPlaceLayer(k, v) for k, v in layers])


def _cache_of(layers: list[InPlaceLayer]) -> DynamicCache:
    cache = DynamicCache()
    cache.layers[:] = layers
    return cache
