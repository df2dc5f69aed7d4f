"""The state pool of the linear-attention layers: a fixed-size state per sequence, in numbered slots.

Each `RecurrentStateSpec` layer keeps, per sequence, a conv window (the last inputs of its short causal
conv, in the model's dtype) and a recurrent matrix per head (float32). A slot holds one sequence's state
for every such layer; the engine hands a slot to each running sequence (engine/state_slots.py) and passes
the batch's slots in `ForwardBatch.state_slots`. All layers' conv windows are one tensor and all their
recurrent states another, so the pool is two allocations whatever the layer count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mili_openai.model.cache_spec import RECURRENT_DTYPE, LayerCacheSpec, RecurrentStateSpec, recurrent_layers


def _recurrent_spec(specs: Sequence[LayerCacheSpec]) -> tuple[list[int], RecurrentStateSpec]:
    """(the linear-attention layers' decoder indices, their one spec): the pool is one tensor per kind."""
    layers = recurrent_layers(specs)
    if not layers:
        raise ValueError("a state cache needs at least one linear-attention layer (RecurrentStateSpec)")
    shapes = {specs[index] for index in layers}
    if len(shapes) > 1:
        raise ValueError(f"linear-attention layers with different state shapes are not supported: "
                         f"{sorted(map(str, shapes))}")
    return layers, specs[layers[0]]


class StateCache:
    def __init__(self, specs: Sequence[LayerCacheSpec], num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """specs: the model's cache spec per decoder layer; slots for its linear-attention layers."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        layers, spec = _recurrent_spec(specs)
        self.num_slots = num_slots
        self._index_of_layer = {decoder_index: index for index, decoder_index in enumerate(layers)}
        self.conv = torch.zeros((len(layers), num_slots, *spec.conv_shape), dtype=dtype, device=device)
        self.recurrent = torch.zeros((len(layers), num_slots, *spec.recurrent_shape), dtype=RECURRENT_DTYPE,
                                     device=device)
        # CPU pools move slots one slice at a time: torch's index ops along dim 1 of a 5-D pool run ~10 ms a slot
        # there from two slots up (one slot's slice copy: ~1 ms); a device's keep them (no host reads of indices)
        self._by_slot = self.conv.device.type == "cpu"
        # the states a step verifying drafts keeps per decode row (keep_verified_states); None outside one
        self.kept_conv: torch.Tensor | None = None
        self.kept_recurrent: torch.Tensor | None = None

    @staticmethod
    def bytes_per_slot(specs: Sequence[LayerCacheSpec], dtype: torch.dtype) -> int:
        """Bytes one sequence's state takes across every linear-attention layer (0 without any)."""
        return sum(spec.bytes_per_sequence(dtype) for spec in specs if isinstance(spec, RecurrentStateSpec))

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv (slots, *conv_shape), recurrent (slots, *recurrent_shape) float32) of decoder layer `index`."""
        position = self._index_of_layer.get(index)
        if position is None:
            raise ValueError(f"decoder layer {index} is not a linear-attention layer: it keeps no state")
        return self.conv[position], self.recurrent[position]

    def reset(self, slots: torch.Tensor) -> None:
        """Zero these slots in every layer: a new sequence starts from zeros (the conv's causal padding)."""
        if self._by_slot:
            for slot in slots.tolist():
                self.conv[:, slot].zero_()
                self.recurrent[:, slot].zero_()
            return
        slots = slots.to(self.conv.device)
        self.conv.index_fill_(1, slots, 0)
        self.recurrent.index_fill_(1, slots, 0)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """State of slots `src` into slots `dst`, pairwise, in every layer (a fork: n > 1, snapshots)."""
        if self._by_slot and not set(src.tolist()) & set(dst.tolist()):  # no pair reads a slot another writes
            for source, target in zip(src.tolist(), dst.tolist()):
                self.conv[:, target].copy_(self.conv[:, source])
                self.recurrent[:, target].copy_(self.recurrent[:, source])
            return
        for pool in (self.conv, self.recurrent):
            _scatter(pool, dst, _gather(pool, src, self._by_slot), self._by_slot)

    def save(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of these slots' (conv, recurrent) states in every layer, for `restore`."""
        return _gather(self.conv, slots, self._by_slot), _gather(self.recurrent, slots, self._by_slot)

    def restore(self, slots: torch.Tensor, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Put back the states `save` copied from these slots."""
        _scatter(self.conv, slots, saved[0], self._by_slot)
        _scatter(self.recurrent, slots, saved[1], self._by_slot)

    def keep_verified_states(self, num_rows: int | None) -> None:
        """For a step whose decodes verify drafts: buffers where each of its `num_rows` decode rows leaves the
        state of every linear layer (GatedDeltaNet's `kept`), until the next such step; None frees them."""
        if num_rows is None:
            self.kept_conv = self.kept_recurrent = None
            return
        self.kept_conv = self.conv.new_empty((self.conv.shape[0], num_rows, *self.conv.shape[2:]))
        self.kept_recurrent = self.recurrent.new_empty((self.recurrent.shape[0], num_rows, *self.recurrent.shape[2:]))

    def kept(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(conv, recurrent) buffers of decoder layer `index` for the step's decode rows; None outside such a step."""
        if self.kept_conv is None:
            return None
        position = self._index_of_layer[index]
        return self.kept_conv[position], self.kept_recurrent[position]

    def restore_kept(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Roll slots back to the state decode row `rows` left (pairwise): a decode whose drafts were rejected
        after that row stands where its last accepted token left it."""
        _scatter(self.conv, slots, _gather(self.kept_conv, rows, self._by_slot), self._by_slot)
        _scatter(self.recurrent, slots, _gather(self.kept_recurrent, rows, self._by_slot), self._by_slot)

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * self.recurrent.element_size()


def _gather(pool: torch.Tensor, slots: torch.Tensor, by_slot: bool) -> torch.Tensor:
    """pool[:, slots], a copy (layers, len(slots), ...)."""
    if by_slot and slots.numel():
        return torch.stack([pool[:, slot] for slot in slots.tolist()], dim=1)
    return pool.index_select(1, slots.to(pool.device))


def _scatter(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, by_slot: bool) -> None:
    """pool[:, slots] = values (layers, len(slots), ...)."""
    if by_slot:
        for index, slot in enumerate(slots.tolist()):
            pool[:, slot].copy_(values[:, index])
        return
    pool.index_copy_(1, slots.to(pool.device), values)
