"""A KV cache that grows in place while sampling, in place of one concatenation per step.

`DynamicLayer.update` concatenates each decoding step's keys and values onto the layer's cache:
every step copies the whole cache of every layer, prompt included, a cost that grows with the
length sampled (a tenth of SmolLM2's sampling time at 32 x 64 tokens on a CPU). `RoomyLayer`
holds them in a buffer with room for the tokens to come, writes each step's into the room and
gives attention a view of the filled part: the same keys and values, copied only when the room
runs out. `make_room` puts it in place of a cache's plain dynamic layers once the prompt is in.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

MIN_ROOM = 64  # tokens of room added at least, each time the room runs out


def make_room(cache, max_length: int | None = None) -> None:
    """Replaces the plain `DynamicLayer`s of `cache` (a `DynamicCache`, its prompt in) by
    `RoomyLayer`s holding the same keys and values, with room up to `max_length` tokens (the
    longest sequence the sampling will reach; None: no bound). Other layers and caches are left
    as they are."""
    if not isinstance(cache, DynamicCache):
        return
    cache.layers = [
        RoomyLayer(layer, max_length)
        if type(layer) is DynamicLayer and layer.is_initialized
        else layer
        for layer in cache.layers
    ]


class RoomyLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys` and `values` `(rows, heads, n, head_dim)` are the first n
    positions of buffers with room for more.

    A step's states are written into the room; when it runs out, the buffers grow by at least
    `MIN_ROOM` tokens or half the length (one copy), never past `max_length` unless a step
    needs it. Selecting rows copies the buffers' rows. Whatever else replaces `keys` (offload,
    beam reordering) is taken into a new buffer at the next update.
    """

    def __init__(self, layer: DynamicLayer, max_length: int | None = None):
        super().__init__()
        self.max_length = max_length
        self._key_buffer = self._value_buffer = None
        if layer.is_initialized:
            self.device, self.is_initialized = layer.device, True
            self.keys, self.values = layer.keys, layer.values
            self._grow(0)

    def _room_for(self, length: int, new: int) -> int:
        wanted = length + max(MIN_ROOM, length // 2)
        if self.max_length is not None:
            wanted = min(wanted, self.max_length)
        return max(wanted, length + new)

    def _grow(self, new: int) -> None:
        """New buffers holding `keys` and `values`, with room for at least `new` more tokens."""
        rows, heads, length, _ = self.keys.shape
        capacity = self._room_for(length, new)
        self._key_buffer = self.keys.new_empty((rows, heads, capacity, self.keys.shape[-1]))
        self._value_buffer = self.values.new_empty(
            (rows, self.values.shape[1], capacity, self.values.shape[-1])
        )
        self._key_buffer[:, :, :length] = self.keys
        self._value_buffer[:, :, :length] = self.values
        self._view(length)

    def _view(self, length: int) -> None:
        self.keys = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]

    def _in_buffers(self) -> bool:
        """Whether `keys` and `values` are still the first positions of the buffers."""
        buffers = (self._key_buffer, self._value_buffer)
        states = (self.keys, self.values)
        return self._key_buffer is not None and all(
            state.data_ptr() == buffer.data_ptr()
            and state.shape[:2] == buffer.shape[:2]
            and state.stride() == buffer.stride()
            for state, buffer in zip(states, buffers)
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            self._grow(0)
            return self.keys, self.values
        length, new = self.keys.shape[-2], key_states.shape[-2]
        if not self._in_buffers() or length + new > self._key_buffer.shape[-2]:
            self._grow(new)
        self._key_buffer[:, :, length : length + new] = key_states
        self._value_buffer[:, :, length : length + new] = value_states
        self._view(length + new)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() == 0:
            return
        if not self._in_buffers():
            super().batch_select_indices(indices)
            return
        length = self.keys.shape[-2]
        self._key_buffer = self._key_buffer[indices]
        self._value_buffer = self._value_buffer[indices]
        self._view(length)

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()
