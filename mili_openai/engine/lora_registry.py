"""Which LoRA adapters requests may name, and the ids the engine knows them by (plain Python, on the thread that
owns the engine state).

Adapters are numbered from 1 (0 is the base model) in the order they are registered: `--lora-modules` at start,
then each load at run time (`/v1/load_lora_adapter`). An id is never given twice: an adapter unloaded and loaded
again under its name gets a new one, so the prefix cache (whose keys carry the id) never serves K/V computed under
the old weights. Unloading takes the name from new requests at once, as vLLM does; sequences that already run or
wait with it finish on it, and the runner drops its weights (`LoraManager.remove`) once the last of them ends.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from mili_openai.config import LoraConfig
from mili_openai.engine.contract import LoraAdapterExists, UnknownLoraAdapter
from mili_openai.engine.lora_manager import BASE_MODEL_ID, LoraManager
from mili_openai.engine.sequence import Sequence
from mili_openai.model.lora_adapter import LoraAdapter


class LoraRegistry:
    def __init__(self, config: LoraConfig | None, manager: LoraManager | None) -> None:
        """`manager`: the runner's slots and host copies, which hold the `config.modules` as ids 1..n already;
        None with LoRA off."""
        self.manager = manager
        self.served: dict[str, tuple[int, str]] = {}  # name -> (id, path), in registration order
        self.names: dict[int, str] = {}  # id -> name, for every id a live sequence may carry (served or retiring)
        self._retiring: set[int] = set()  # unloaded, still run by live sequences
        self._loading: set[str] = set()  # names being read by a load in progress
        self._ids = itertools.count(BASE_MODEL_ID + 1)
        for name, path in config.modules if config is not None else ():
            self._publish(name, path)

    def served_adapters(self) -> tuple[tuple[str, str], ...]:
        """(name, path) of every adapter a request may name now."""
        return tuple((name, path) for name, (_, path) in self.served.items())

    def id_of(self, name: str) -> int:
        """The id of a served adapter; UnknownLoraAdapter (a 404) for any other name."""
        entry = self.served.get(name)
        if entry is None:
            raise UnknownLoraAdapter(f"no LoRA adapter named {name!r} is loaded", "model")
        return entry[0]

    def adapter_names(self, seqs: Iterable[Sequence]) -> tuple[str, ...]:
        """The adapters `seqs` run with, by name, in id order; () without any."""
        if not self.names:
            return ()
        used = {seq.lora_id for seq in seqs}
        return tuple(name for adapter_id, name in self.names.items() if adapter_id in used)

    # ---- loading at run time: begin (on the engine's thread), read (any thread), finish (the engine's) ----
    def begin_load(self, name: str) -> None:
        """Reserve `name` for a load; ValueError with LoRA off, LoraAdapterExists where it is served or loading."""
        if self.manager is None:
            raise ValueError("LoRA adapters are off: start the engine with --enable-lora")
        if name in self.served or name in self._loading:
            raise LoraAdapterExists(f"The LoRA adapter {name!r} has already been loaded.")
        self._loading.add(name)

    def read(self, name: str, path: str) -> LoraAdapter:
        """The adapter at `path`, checked against the base (AdapterError naming what is wrong). Touches no state."""
        return self.manager.read(name, path)

    def finish_load(self, name: str, path: str, adapter: LoraAdapter | None) -> None:
        """Serve `adapter` (read by `read`) under `name`; None: the load failed, the name is free again."""
        self._loading.discard(name)
        if adapter is not None:
            self.manager.add(self._publish(name, path), name, path, adapter)

    def load(self, name: str, path: str) -> None:
        """All three steps on the calling thread (the offline engine)."""
        self.begin_load(name)
        adapter = None
        try:
            adapter = self.read(name, path)
        finally:
            self.finish_load(name, path, adapter)

    def unload(self, name: str, live: Iterable[Sequence]) -> None:
        """Stop serving `name` (UnknownLoraAdapter if it is not served); `live`: the engine's sequences, which keep
        running on it."""
        entry = self.served.pop(name, None)
        if entry is None:
            raise UnknownLoraAdapter(f"The LoRA adapter {name!r} cannot be found.", "lora_name")
        self._retiring.add(entry[0])
        self.sequence_ended(entry[0], live)

    def sequence_ended(self, adapter_id: int, live: Iterable[Sequence]) -> None:
        """A sequence on `adapter_id` ended: an unloaded adapter's weights go once no `live` sequence runs it."""
        if adapter_id not in self._retiring or any(seq.lora_id == adapter_id for seq in live):
            return
        self._retiring.discard(adapter_id)
        del self.names[adapter_id]
        self.manager.remove(adapter_id)

    def _publish(self, name: str, path: str) -> int:
        adapter_id = next(self._ids)
        self.served[name] = (adapter_id, path)
        self.names[adapter_id] = name
        return adapter_id
