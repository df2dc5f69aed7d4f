"""Which LoRA adapters are loaded on the host, and which sit in the model's slots (the runner's side; the
engine's names and ids: engine/lora_registry.py).

The scheduler and the prefix cache see only adapter ids (0 is the base model). `LoraManager` turns each step's
per-row ids into row groups over slots, loading an adapter into the least recently used slot that the step
does not need, and from disk into a host cache of `max_cpu_loras` (also least recently used) when it is not
there. Steps launch in order on one thread (or one CUDA stream), so a slot is rewritten only after the steps
before have read it. The scheduler keeps the adapters of one step within `max_loras`. Adapters loaded and
unloaded at run time (`add`, `remove`) change the tables from the engine's thread while a step may be launching
on another: a lock keeps each change whole.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from mili_openai.config import LoraConfig
from mili_openai.kernels.lora import LoraGroup, lora_groups
from mili_openai.model.lora_adapter import LoraAdapter, load_lora_adapter
from mili_openai.model.lora_layers import LoraSlots

BASE_MODEL_ID = 0  # a sequence on the base model alone


class LoraManager:
    """Adapters on the host and in the model's slots (wrapping the model's projections at construction)."""

    def __init__(self, config: LoraConfig, model: nn.Module) -> None:
        self.config = config
        self.slots = LoraSlots(model, config.max_loras, config.max_lora_rank)
        # id -> (name, path): the `config.modules` numbered from 1, as LoraRegistry numbers them, then those `add`ed.
        # Kept after `remove` (a few strings each): a step planned before then may still name the id
        self.paths = dict(enumerate(config.modules, start=1))
        self._lock = threading.Lock()  # around every use of the tables below (see the module doc)
        self._host: OrderedDict[int, LoraAdapter] = OrderedDict()  # LRU: most recently used last
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU likewise
        for adapter_id in self.paths:  # every adapter checked at start: a bad one is refused before serving
            self._adapter(adapter_id)

    def read(self, name: str, path: str) -> LoraAdapter:
        """The adapter at `path`, checked against this model (AdapterError naming what is wrong)."""
        return load_lora_adapter(name, path, self.slots.shapes, self.config.max_lora_rank)

    def add(self, adapter_id: int, name: str, path: str, adapter: LoraAdapter) -> None:
        """Serve `adapter` (`read` already) as `adapter_id`, kept on the host from now, as a fresh load would be."""
        with self._lock:
            self.paths[adapter_id] = (name, path)
            self._keep(adapter_id, adapter)

    def remove(self, adapter_id: int) -> None:
        """Let an unloaded adapter's host copy and slot go (the slot is rewritten when another adapter needs it)."""
        with self._lock:
            self._host.pop(adapter_id, None)
            self._slot_of.pop(adapter_id, None)

    def on_host(self) -> tuple[int, ...]:
        """The ids of the adapters held on the host, least recently used first."""
        with self._lock:
            return tuple(self._host)

    def groups(self, row_ids: np.ndarray | None, device: torch.device) -> list[LoraGroup]:
        """The step's row groups over slots (`row_ids`: each row's adapter id; None: all on the base), with every
        adapter they need put in a slot first."""
        if row_ids is None:
            return []
        present = [int(adapter_id) for adapter_id in np.unique(row_ids) if adapter_id != BASE_MODEL_ID]
        if len(present) > self.slots.num_slots:
            raise RuntimeError(f"a step runs {len(present)} LoRA adapters, over max_loras {self.slots.num_slots}")
        with self._lock:
            slot_of = {adapter_id: self._slot(adapter_id, present) for adapter_id in present}
        slot_of[BASE_MODEL_ID] = -1
        return lora_groups([slot_of[int(adapter_id)] for adapter_id in row_ids], device)

    def _slot(self, adapter_id: int, needed: list[int]) -> int:
        """The adapter's slot, loading it into a free one or the least recently used one not `needed`."""
        slot = self._slot_of.pop(adapter_id, None)
        if slot is None:
            used = set(self._slot_of.values())
            free = [slot for slot in range(self.slots.num_slots) if slot not in used]
            if free:
                slot = free[0]
            else:
                victim = next(other for other in self._slot_of if other not in needed)
                slot = self._slot_of.pop(victim)
            self.slots.load(slot, self._adapter(adapter_id))
        self._slot_of[adapter_id] = slot
        return slot

    def _adapter(self, adapter_id: int) -> LoraAdapter:
        """The adapter's weights on the host, read from disk if the host cache lost them."""
        adapter = self._host.pop(adapter_id, None)
        if adapter is None:
            adapter = self.read(*self.paths[adapter_id])
        self._keep(adapter_id, adapter)
        return adapter

    def _keep(self, adapter_id: int, adapter: LoraAdapter) -> None:
        """Hold `adapter` on the host as the most recently used, the least recently used beyond capacity let go."""
        self._host[adapter_id] = adapter
        while len(self._host) > self.config.cpu_capacity:
            self._host.popitem(last=False)
