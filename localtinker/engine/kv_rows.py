"""KV cache rows left-aligned by padding: the prefill's cache, and the pieces of ``shared_prompt_kv.py``.

Every row's tokens end at the last column, and a 0/1 attention mask ``[rows, columns]`` hides padding
and holes. Explicit position ids keep each real token where it would be alone, so padding never changes
a result. Columns that no row attends to any more are dropped from the left (:func:`first_used_column`).

``ColumnBufferLayer`` keeps spare columns after the last one, so a decode step writes its column in
place; transformers' ``DynamicLayer`` concatenates instead, copying the whole cache at every step.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

SPARE_COLUMNS = 32


class ColumnBufferLayer(DynamicLayer):
    """``keys``/``values`` are views of buffers with spare columns; appends write in place."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        super().__init__()
        if keys is not None and values is not None:
            self._adopt(keys, values)

    @classmethod
    def over(cls, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> ColumnBufferLayer:
        """A layer over these buffers (no copy): their first ``length`` columns are its keys and values,
        the rest spare. A buffer sized exactly for what will be written makes no copy at all."""
        layer = cls()
        layer._key_buffer, layer._value_buffer = key_buffer, value_buffer
        layer.keys, layer.values = key_buffer[:, :, :length], value_buffer[:, :, :length]
        layer.dtype, layer.device, layer.is_initialized = key_buffer.dtype, key_buffer.device, True
        return layer

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, spare: int = SPARE_COLUMNS) -> None:
        rows, heads, length, dim = keys.shape
        self._key_buffer = keys.new_empty((rows, heads, length + spare, dim))
        self._value_buffer = values.new_empty((rows, heads, length + spare, values.shape[-1]))
        self._key_buffer[:, :, :length] = keys
        self._value_buffer[:, :, :length] = values
        self.keys = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self._adopt(key_states, value_states)
            return self.keys, self.values
        length, new = self.keys.shape[-2], key_states.shape[-2]
        if length + new > self._key_buffer.shape[-2]:
            self._adopt(self.keys, self.values, spare=max(new, length // 2, SPARE_COLUMNS))
        self._key_buffer[:, :, length : length + new] = key_states
        self._value_buffer[:, :, length : length + new] = value_states
        self.keys = self._key_buffer[:, :, : length + new]
        self.values = self._value_buffer[:, :, : length + new]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._adopt(self.keys[indices], self.values[indices])


class RowCache(DynamicCache):
    """A ``DynamicCache`` made of :class:`ColumnBufferLayer` s."""

    def __init__(self, layers: list[ColumnBufferLayer] | None = None) -> None:
        if layers:
            Cache.__init__(self, layers=layers)
        else:
            Cache.__init__(self, layer_class_to_replicate=ColumnBufferLayer)

    @property
    def width(self) -> int:
        return self.layers[0].keys.shape[-2] if self.layers else 0


def select_rows(cache: RowCache, mask: torch.Tensor, index: torch.Tensor) -> tuple[RowCache, torch.Tensor]:
    """The rows ``index`` (repeats allowed: a prompt's cache copied to each of its samples)."""
    layers = [ColumnBufferLayer(layer.keys[index], layer.values[index]) for layer in cache.layers]
    return RowCache(layers), mask[index]


def first_used_column(mask: torch.Tensor) -> int:
    """The first column that some row of a 0/1 ``mask`` attends to (all of them before it can be dropped)."""
    used = mask.any(dim=0).nonzero()
    return int(used[0]) if len(used) else mask.shape[1]


def left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, heads, columns, dim]`` with zero columns prepended up to ``width``."""
    missing = width - tensor.shape[-2]
    if missing == 0:
        return tensor
    return torch.cat([tensor.new_zeros((*tensor.shape[:2], missing, tensor.shape[-1])), tensor], dim=-2)
