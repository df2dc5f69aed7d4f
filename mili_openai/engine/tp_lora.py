"""LoRA adapters under tensor parallelism, from the engine process's side (engine/tp_forward.py).

Every rank runs a `LoraManager` of its own (engine/lora_manager.py) over its model's slots, which hold its share of
each adapter (model/lora_tensor_parallel.py): the `--lora-modules` are read by each rank at start, and each rank
reads an adapter loaded at run time from its path. The engine process holds no weights: `TensorParallelLora`
checks adapters against the whole model's shapes (so a bad one is refused with the error one rank gives, before
any rank sees it) and queues the registry's loads and unloads (engine/lora_registry.py), which travel to every
rank with the next step (`take_updates`): a step is the only message a worker reads while it serves, and the
registry may change from another thread than the one sending steps.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from mili_openai.config import LoraConfig
from mili_openai.model.config import ModelConfig
from mili_openai.model.lora_adapter import LoraAdapter, load_lora_adapter
from mili_openai.model.lora_targets import target_shapes
from mili_openai.model.lora_tensor_parallel import whole_model_sites


@dataclass(frozen=True, slots=True)
class LoraUpdate:
    """Serve the adapter at `path` as `name` under `adapter_id` from now; `path` None: let `adapter_id` go."""

    adapter_id: int
    name: str | None = None
    path: str | None = None


class TensorParallelLora:
    """The registry's `LoraManager` (its `read`, `add` and `remove`) when the model lives in worker processes."""

    def __init__(self, config: LoraConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.shapes = target_shapes(whole_model_sites(model_config))  # ValueError for a model that serves none
        self._lock = threading.Lock()  # around `_pending`: the registry and the step sender may be two threads
        self._pending: list[LoraUpdate] = []
        for name, path in config.modules:  # refused here, before the workers start, as one rank refuses them
            self.read(name, path)

    def read(self, name: str, path: str) -> LoraAdapter:
        """The adapter at `path`, checked against the whole model (AdapterError naming what is wrong)."""
        return load_lora_adapter(name, path, self.shapes, self.config.max_lora_rank)

    def add(self, adapter_id: int, name: str, path: str, adapter: LoraAdapter) -> None:
        """Serve `adapter` (checked by `read`) as `adapter_id`: every rank reads it from `path` before the next
        step."""
        with self._lock:
            self._pending.append(LoraUpdate(adapter_id, name, str(path)))

    def remove(self, adapter_id: int) -> None:
        with self._lock:
            self._pending.append(LoraUpdate(adapter_id))

    def take_updates(self) -> list[LoraUpdate]:
        """The loads and unloads since the last call, in order, for the next step to carry."""
        with self._lock:
            updates, self._pending = self._pending, []
        return updates
