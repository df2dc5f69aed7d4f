"""Which LoRA adapters exist, which are loaded on the host, and which sit in the model's slots.

Adapters are numbered from 1 in the order `LoraConfig.modules` names them (0 is the base model); the engine's
scheduler and prefix cache see only these ids (`lora_ids`). The runner's `LoraManager` turns each step's
per-row ids into row groups over slots, loading an adapter into the least recently used slot that the step
does not need, and from disk into a host cache of `max_cpu_loras` (also least recently used) when it is not
there. Steps launch in order on one thread (or one CUDA stream), so a slot is rewritten only after the steps
before have read it. The scheduler keeps the adapters of one step within `max_loras`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from mili_openai.config import LoraConfig
from mili_openai.engine.sequence import Sequence
from mili_openai.kernels.lora import LoraGroup, lora_groups
from mili_openai.model.lora_adapter import LoraAdapter, load_lora_adapter
from mili_openai.model.lora_layers import LoraSlots

BASE_MODEL_ID = 0  # a sequence on the base model alone


def lora_ids(config: LoraConfig | None) -> dict[str, int]:
    """{adapter name: its id}, as every part of the engine numbers them."""
    return {} if config is None else {name: index for index, (name, _) in enumerate(config.modules, start=1)}


def adapter_names(seqs: Iterable[Sequence], ids: dict[str, int]) -> tuple[str, ...]:
    """The adapters `seqs` run with (`ids`: as `lora_ids` numbers them), by name, in id order; () without LoRA."""
    if not ids:
        return ()
    used = {seq.lora_id for seq in seqs}
    return tuple(name for name, adapter_id in ids.items() if adapter_id in used)


class LoraManager:
    """Adapters on the host and in the model's slots (wrapping the model's projections at construction)."""

    def __init__(self, config: LoraConfig, model: nn.Module) -> None:
        self.config = config
        self.slots = LoraSlots(model, config.max_loras, config.max_lora_rank)
        self.paths = dict(enumerate(config.modules, start=1))  # id -> (name, path), numbered as `lora_ids`
        self._host: OrderedDict[int, LoraAdapter] = OrderedDict()  # LRU: most recently used last
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU likewise
        for adapter_id in self.paths:  # every adapter checked at start: a bad one is refused before serving
            self._adapter(adapter_id)

    def groups(self, row_ids: np.ndarray | None, device: torch.device) -> list[LoraGroup]:
        """The step's row groups over slots (`row_ids`: each row's adapter id; None: all on the base), with every
        adapter they need put in a slot first."""
        if row_ids is None:
            return []
        present = [int(adapter_id) for adapter_id in np.unique(row_ids) if adapter_id != BASE_MODEL_ID]
        if len(present) > self.slots.num_slots:
            raise RuntimeError(f"a step runs {len(present)} LoRA adapters, over max_loras {self.slots.num_slots}")
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
            name, path = self.paths[adapter_id]
            adapter = load_lora_adapter(name, path, self.slots.shapes, self.config.max_lora_rank)
        self._host[adapter_id] = adapter
        while len(self._host) > self.config.cpu_capacity:
            self._host.popitem(last=False)
        return adapter
