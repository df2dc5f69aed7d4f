"""LoRA on a loaded model: each projection that takes it (model/lora_targets.py) wrapped in a `LoraLinear` holding a
fixed table of adapter slots, and the `LoraSlots` that load adapters into slots and tell every projection which rows
run which slot.

A slot of a fused projection stacks its PEFT modules' pairs: A rows [i * R, i * R + r) are module i's
(R = the slot rank, r <= R its own), and B is block-diagonal (module i's output rows read only its A rows), so
one shrink and one expand matmul serve q, k and v (or gate and up, or Gated DeltaNet's four inputs) at once. Unused
rows stay zero.

The projections take only `x` (as every projection and the compiled paths do), so the step's row groups
reach them through the `LoraSlots` they share, set for the length of one forward (`LoraSlots.rows`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from mili_openai.kernels.lora import LoraGroup
from mili_openai.model.kernel_backend import KernelBackend, require_backend
from mili_openai.model.lora_adapter import LoraAdapter, TargetShape
from mili_openai.model.lora_targets import LoraModule, LoraSite, lora_sites


class LoraLinear(nn.Module):
    """A projection plus the delta of whichever adapter slot each row runs with; rows with none get the base
    projection's output untouched. `base` is any projection (dense, int8/int4, fp8): the delta runs in the
    activations' dtype, through the model's backend (`lora`, the segmented matmul)."""

    def __init__(self, base: nn.Module, site: LoraSite, slots: LoraSlots, backend: KernelBackend) -> None:
        super().__init__()
        self.base = base
        self.backend = require_backend(backend)
        self.targets: tuple[LoraModule, ...] = site.modules  # the PEFT modules it stacks, in its rows' order
        self.slots = slots
        width = len(self.targets) * slots.max_rank
        kwargs = dict(dtype=slots.dtype, device=slots.device)
        self.register_buffer("lora_a", torch.zeros(slots.num_slots, width, site.in_features, **kwargs),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(slots.num_slots, sum(t.out_features for t in self.targets), width,
                                                   **kwargs), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        groups = self.slots.groups
        return self.backend.lora(out, x, self.lora_a, self.lora_b, groups) if groups else out

    def load(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter's pairs (one per stacked module; None where it leaves the module alone) into `slot`."""
        rank = self.slots.max_rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        out_row = 0
        for index, (target, pair) in enumerate(zip(self.targets, pairs)):
            if pair is not None:
                a, b = pair  # (r, in), (out, r)
                if target.row_order is not None:  # the module's rows into the projection's order
                    b = b[target.row_order.to(b.device)]
                columns = slice(index * rank, index * rank + a.shape[0])
                self.lora_a[slot, columns].copy_(a)
                self.lora_b[slot, out_row : out_row + target.out_features, columns].copy_(b)
            out_row += target.out_features


class LoraSlots:
    """`num_slots` adapter slots on every LoRA projection of `model` (which it wraps at construction)."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int) -> None:
        sites = lora_sites(model)  # ValueError for a model that serves none
        if model.parallel is not None:
            raise ValueError("LoRA adapters are not served under tensor parallelism yet")
        self.num_slots, self.max_rank = num_slots, max_rank
        self.dtype, self.device = model.dtype, model.model.norm.weight.device
        self.groups: list[LoraGroup] = []  # the running forward's row groups (`rows`); empty: no adapter runs
        self.shapes: dict[tuple[int, str], TargetShape] = {}  # what adapters may target (load_lora_adapter)
        self.projections: list[tuple[int, LoraLinear]] = []
        for site in sites:
            projection = LoraLinear(getattr(site.parent, site.attribute), site, self, model.backend)
            setattr(site.parent, site.attribute, projection)
            self.projections.append((site.layer, projection))
            for target in site.modules:
                self.shapes[(site.layer, target.name)] = TargetShape(site.in_features, target.out_features)
        # the compiled decode stack holds the base projections alone: steps run layer by layer from now on
        # (`build_decode_stack` keeps it off, as a LoraLinear is no plain projection)
        model.model.decode_stack = None

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
    def rows(self, groups: list[LoraGroup]) -> Iterator[None]:
        """Within this block, every LoRA projection adds each group's adapter to its rows."""
        self.groups = groups
        try:
            yield
        finally:
            self.groups = []
