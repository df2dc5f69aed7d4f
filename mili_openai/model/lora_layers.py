"""LoRA on a loaded model: each projection that takes it (model/lora_targets.py) wrapped in a `LoraLinear` holding a
fixed table of adapter slots, and the `LoraSlots` that load adapters into slots and tell every projection which rows
run which slot.

A slot of a fused projection stacks its PEFT modules' pairs: A rows [i * R, i * R + r) are module i's
(R = the slot rank, r <= R its own), and B is block-diagonal (module i's output rows read only its A rows), so
one shrink and one expand matmul serve q, k and v (or gate and up, or Gated DeltaNet's four inputs) at once. Unused
rows stay zero. B is held transposed (W, out): a module's rows of it are its columns' whole delta, which the CPU
kernel reads alone (kernels/lora.py).

The projections take only `x` (as every projection and the compiled paths do), so the step's row groups
reach them through the `LoraSlots` they share, set for the length of one forward (`LoraSlots.rows`). Under tensor
parallelism each rank's slots hold its share of every adapter (model/lora_tensor_parallel.py). A model's
compiled CPU decode stack (model/qwen3.py) keeps running decode steps: it is handed every projection's slots and
adds each row's delta inside (`LoraDecodeStack`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from mili_openai.kernels.cpu_decode_stack import CpuDecodeStack
from mili_openai.kernels.lora import LoraGroup, LoraRows, LoraSlotTable
from mili_openai.model.kernel_backend import KernelBackend, require_backend
from mili_openai.model.lora_adapter import LoraAdapter, TargetShape
from mili_openai.model.lora_targets import LoraModule, LoraSite, lora_sites, target_shapes
from mili_openai.model.lora_tensor_parallel import shard_lora_sites, whole_model_sites


class LoraLinear(nn.Module):
    """A projection plus the delta of whichever adapter slot each row runs with; rows with none get the base
    projection's output untouched. `base` is any projection (dense, int8/int4, fp8): the delta runs in the
    activations' dtype, through the model's backend (`lora`: the segmented matmul, or the CPU kernel)."""

    def __init__(self, base: nn.Module, site: LoraSite, slots: LoraSlots, backend: KernelBackend) -> None:
        super().__init__()
        self.base = base
        self.backend = require_backend(backend)
        self.targets: tuple[LoraModule, ...] = site.modules  # the PEFT modules it stacks, in its rows' order
        self.slots = slots
        width = len(self.targets) * slots.max_rank
        self.offsets = (0, *itertools.accumulate(target.out_features for target in self.targets))  # modules' columns
        kwargs = dict(dtype=slots.dtype, device=slots.device)
        self.register_buffer("lora_a", torch.zeros(slots.num_slots, width, site.in_features, **kwargs),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(slots.num_slots, width, self.offsets[-1], **kwargs),
                             persistent=False)  # B transposed

    @property
    def table(self) -> LoraSlotTable:
        """The slots as the LoRA ops take them (the buffers themselves: loads into them are seen)."""
        return LoraSlotTable(self.lora_a, self.lora_b, self.offsets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        rows = self.slots.active
        return out if rows is None else self.backend.lora(out, x, self.table, rows)

    def load(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter's pairs (one per stacked module; None where it leaves the module alone) into `slot`."""
        rank = self.slots.max_rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        out_row = 0
        for index, (target, pair) in enumerate(zip(self.targets, pairs)):
            if pair is not None:
                a, b = pair  # (r, in), (out, r)
                if target.row_order is not None:  # the module's rows into the projection's order (or a rank's)
                    b = b[target.row_order.to(b.device)]
                if target.columns is not None:  # a row-parallel rank's input features
                    a = a[:, target.columns.to(a.device)]
                columns = slice(index * rank, index * rank + a.shape[0])
                self.lora_a[slot, columns].copy_(a)
                self.lora_b[slot, columns, out_row : out_row + target.out_features].copy_(b.T)
            out_row += target.out_features


class LoraSlots:
    """`num_slots` adapter slots on every LoRA projection of `model` (which it wraps at construction)."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int) -> None:
        sites = whole = lora_sites(model)  # ValueError for a model that serves none
        if model.parallel is not None:  # this rank's share of each adapter (model/lora_tensor_parallel.py)
            whole = whole_model_sites(model.config, type(model))
            sites = shard_lora_sites(sites, whole, model.config, model.parallel)
        self.num_slots, self.max_rank = num_slots, max_rank
        self.dtype, self.device = model.dtype, model.model.norm.weight.device
        self.active: LoraRows | None = None  # the running forward's rows by slot (`rows`); None: no adapter runs
        # what adapters may target (load_lora_adapter): the whole model's shapes
        self.shapes: dict[tuple[int, str], TargetShape] = target_shapes(whole)
        self.projections: list[tuple[int, LoraLinear]] = []
        for site in sites:
            projection = LoraLinear(getattr(site.parent, site.attribute), site, self, model.backend)
            setattr(site.parent, site.attribute, projection)
            self.projections.append((site.layer, projection))
        # the compiled CPU decode stack holds the same base projections, in the sites' order: it takes the slots
        # too; any other runs steps layer by layer from now on (`build_decode_stack` keeps a stack off later, as
        # a LoraLinear is no plain projection: CPU kernels that come in after this leave decode layer by layer)
        stack = model.model.decode_stack
        model.model.decode_stack = LoraDecodeStack(stack, self) if isinstance(stack, CpuDecodeStack) else None

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in `slot` on every projection (zeros where it targets nothing)."""
        with torch.inference_mode():
            for index, projection in self.projections:
                projection.load(slot, [self._pair(adapter, index, target.name) for target in projection.targets])

    def _pair(self, adapter: LoraAdapter, index: int, module: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        pair = adapter.weights.get((index, module))
        if pair is None:
            return None
        return pair[0].to(self.device, self.dtype), pair[1].to(self.device, self.dtype)

    @contextmanager
    def rows(self, groups: list[LoraGroup] | LoraRows) -> Iterator[None]:
        """Within this block, every LoRA projection adds each group's adapter to its rows (`groups`, or a CUDA graph
        bucket's `BucketLoraRows`)."""
        self.active = groups if isinstance(groups, LoraRows) else LoraRows(groups) if groups else None
        try:
            yield
        finally:
            self.active = None


class LoraDecodeStack:
    """A model's compiled CPU decode stack with every LoRA projection's slots on its linears (a `DecodeStack`,
    model/qwen3.py): each row adds its slot's delta in the stack, as the modules would."""

    def __init__(self, stack: CpuDecodeStack, slots: LoraSlots) -> None:
        stack.set_lora([projection.table for _, projection in slots.projections])
        self.stack, self.slots = stack, slots

    @property
    def max_rows(self) -> int:
        return self.stack.max_rows

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, pools: torch.Tensor,
                slot_mapping: torch.Tensor, page_table: torch.Tensor, page_size: int,
                ctx_lens: torch.Tensor) -> torch.Tensor:
        rows = self.slots.active
        lora_slots = None if rows is None else rows.per_row(input_ids.shape[0], input_ids.device)
        return self.stack.forward(input_ids, cos, signed_sin, pools, slot_mapping, page_table, page_size, ctx_lens,
                                  lora_slots)
