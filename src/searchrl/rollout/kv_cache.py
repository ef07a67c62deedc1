"""The continuous batch's KV cache: one buffer per layer, rows as slots, written in place.

transformers' `DynamicLayer` concatenates each new token onto the whole cache, so every decode step copies
every row's keys and values in every layer; and a continuous batch that keeps its rows packed copies the whole
cache again whenever a row leaves (an index over the rows) or joins (left-padding and concatenating). On the
quickstart's continuous batch those copies were a third of the rollout's time (`benchmarks/rollout_overhead.py`).

A `SlotLayer` keeps keys and values in buffers (slots, heads, columns, head dim) with room, and exposes the
window in use, ``[:rows, :, lo:hi]``, as its ``keys``/``values`` (views): a decode step writes its token at
column ``hi`` in place; a row that leaves only frees its slot; a row that joins is written into a free slot,
right-aligned at ``hi`` like every other row (left-padded); dropping columns on the left moves ``lo``. The
buffers are copied only to grow (by half again) and to pack the slots when most are free. The model calls
``update`` as on any `DynamicLayer`; the continuous batch (`searchrl.rollout.continuous`) decides which slot
holds which request and keeps the attention mask (a padded or free column is masked there, and holds zeros or
values the model computed, so a masked key or value is always finite).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def _room(n: int) -> int:
    """Columns (or slots) to leave free beside ``n`` used ones: half again, at least 32."""
    return max(32, n // 2)


class SlotLayer(DynamicLayer):
    """One layer's keys and values for a continuous batch (module docstring)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, max_slots: int | None = None) -> None:
        """Start from a cache's rows (rows, heads, length, head dim), copied into buffers with room; at most
        ``max_slots`` slots are ever allocated (the batch's size; None: no bound)."""
        super().__init__()
        self.device, self.is_initialized, self.max_slots = keys.device, True, max_slots
        rows, _, n, _ = keys.shape
        self.rows, self.lo, self.hi = rows, _room(n), _room(n) + n
        self._k = keys.new_zeros((rows, keys.shape[1], self.hi + _room(n), keys.shape[3]))
        self._v = torch.zeros_like(self._k)
        self._k[:, :, self.lo : self.hi] = keys
        self._v[:, :, self.lo : self.hi] = values
        self._expose()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's step: every slot's new columns written at ``hi``, in place."""
        n = key_states.shape[-2]
        if self.hi + n > self._k.shape[2]:
            self._regrow(cols=self.hi + n + _room(self.hi - self.lo + n))
        self._k[: self.rows, :, self.hi : self.hi + n] = key_states
        self._v[: self.rows, :, self.hi : self.hi + n] = value_states
        self.hi += n
        return self._expose()

    def widen(self, width: int) -> None:
        """Make the window at least ``width`` columns, extending it on the left; the new columns are zeros."""
        lo = self.hi - width
        if lo >= self.lo:
            return
        if lo < 0:
            self._regrow(left=-lo + _room(width))
            lo = self.hi - width
        self._k[: self.rows, :, lo : self.lo] = 0
        self._v[: self.rows, :, lo : self.lo] = 0
        self.lo = lo
        self._expose()

    def place(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Requests' cache rows (rows, heads, n, head dim) into ``slots``, right-aligned at ``hi``, zeros before
        them (the window must already be ``n`` wide: `widen`); slots past the used ones open the slots up to
        them."""
        top = int(slots.max()) + 1
        if top > self._k.shape[0]:
            bound = max(top, self.max_slots) if self.max_slots is not None else top + _room(top)
            self._regrow(slots=min(top + _room(top), bound))
        self.rows = max(self.rows, top)
        n = keys.shape[2]
        self._k[slots, :, self.lo : self.hi - n] = 0
        self._v[slots, :, self.lo : self.hi - n] = 0
        self._k[slots, :, self.hi - n : self.hi] = keys
        self._v[slots, :, self.hi - n : self.hi] = values
        self._expose()

    def trim(self, first: int) -> None:
        """Drop the window's first ``first`` columns (no copy)."""
        self.lo += first
        self._expose()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep these slots, packed to the front in this order (one copy of the window)."""
        k = self._k[:, :, self.lo : self.hi].index_select(0, indices)
        v = self._v[:, :, self.lo : self.hi].index_select(0, indices)
        self.rows = len(indices)
        self._k[: self.rows, :, self.lo : self.hi] = k
        self._v[: self.rows, :, self.lo : self.hi] = v
        self._expose()

    def _regrow(self, slots: int | None = None, cols: int | None = None, left: int = 0) -> None:
        """New buffers with ``slots`` slots, ``cols`` columns, ``left`` more columns before ``lo``; the window
        copied (the only copies of the whole cache besides packing the slots)."""
        slots = max(slots or 0, self._k.shape[0])
        cols = max(cols or 0, self._k.shape[2]) + left
        k = self._k.new_zeros((slots, self._k.shape[1], cols, self._k.shape[3]))
        v = torch.zeros_like(k)
        k[: self.rows, :, self.lo + left : self.hi + left] = self._k[: self.rows, :, self.lo : self.hi]
        v[: self.rows, :, self.lo + left : self.hi + left] = self._v[: self.rows, :, self.lo : self.hi]
        self._k, self._v, self.lo, self.hi = k, v, self.lo + left, self.hi + left

    def _expose(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = self._k[: self.rows, :, self.lo : self.hi]
        self.values = self._v[: self.rows, :, self.lo : self.hi]
        return self.keys, self.values


def slot_cache(cache: Any, max_slots: int | None = None) -> DynamicCache:
    """A model's returned cache (its rows the first slots) as a `DynamicCache` of `SlotLayer`s."""
    out = DynamicCache()
    out.layers = [SlotLayer(x.keys, x.values, max_slots) for x in cache.layers]
    return out
