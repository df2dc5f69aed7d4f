"""State-slot bookkeeping for models with linear-attention layers: one slot per running sequence.

Plain Python beside the page pool (engine/kv_pages.py): a slot indexes the state pool of every
linear-attention layer (model/state_cache.py). A sequence takes a slot when it is admitted and gives it
back when it finishes, is aborted or is preempted (it then resumes into a fresh slot from its latest state
snapshot in the prefix cache, engine/state_snapshots.py, or from its first token). A slot handed out is
zeroed by the runner before the step that first uses it runs (`ScheduledBatch.new_state_slots`), so a new
sequence starts from zeros whatever the slot held before. Every slot is free or owned by exactly one
sequence (`Sequence.state_slot`); `check_integrity` verifies it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from mili_openai.config import EngineConfig
from mili_openai.engine.sequence import Sequence
from mili_openai.radix import PagePool

logger = logging.getLogger(__name__)


def config_for_state_slots(config: EngineConfig, num_snapshots: int) -> EngineConfig:
    """The engine's config for a model with linear-attention layers. Prefix reuse only with state snapshots
    (engine/state_snapshots.py): cached pages hold K/V alone, and a sequence resumed from them alone would miss
    its recurrent state."""
    if not config.enable_prefix_caching:
        return config
    if num_snapshots:
        logger.info("prefix caching: a prefix resumes from a state snapshot at its end (%d snapshots), never from "
                    "K/V alone", num_snapshots)
        return config
    logger.info("prefix caching is off: this model has linear-attention layers and no state snapshots (no room "
                "left for them: --hybrid-snapshot-fraction, --num-hybrid-snapshots)")
    return dataclasses.replace(config, enable_prefix_caching=False)


class StateSlotManager:
    def __init__(self, num_slots: int) -> None:
        self.pool = PagePool(num_slots)  # a free list of ids with double-free checks: the same job as for pages

    @property
    def num_slots(self) -> int:
        return self.pool.num_pages

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def allocate(self, seq: Sequence) -> bool:
        """Give seq a slot unless it holds one; False (nothing done) when none is free."""
        if seq.state_slot is not None:
            return True
        if self.pool.num_free == 0:
            return False
        seq.state_slot = self.pool.allocate(1)[0]
        return True

    def release(self, seq: Sequence) -> None:
        """Take seq's slot back, if it holds one."""
        if seq.state_slot is not None:
            self.pool.free([seq.state_slot])
            seq.state_slot = None

    def check_integrity(self, sequences: Iterable[Sequence]) -> None:
        """RuntimeError unless free slots and the sequences' slots account for every slot exactly once."""
        self.pool.check_integrity()
        owned = [seq.state_slot for seq in sequences if seq.state_slot is not None]
        if len(owned) != len(set(owned)):
            raise RuntimeError(f"state slots: a slot is owned by two sequences: {sorted(owned)}")
        free = set(self.pool.free_page_ids())
        both = free.intersection(owned)
        if both:
            raise RuntimeError(f"state slots: slots both free and owned: {sorted(both)[:8]}")
        if len(free) + len(owned) != self.num_slots:
            raise RuntimeError(f"state slots: {len(free)} free + {len(owned)} owned != {self.num_slots} slots "
                               "(a slot leaked)")

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_pages
