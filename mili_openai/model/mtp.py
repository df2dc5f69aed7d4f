"""The multi-token-prediction (MTP) weights that Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints carry under `mtp.`.

Held as loaded, under the checkpoint's own names (`mtp.fc.weight`, `mtp.layers.0.self_attn.q_proj.weight`, ...);
with `--speculative-config '{"method": "mtp", ...}'` they become the MTP module that drafts
(model/mtp_predictor.py). Keeping them costs their memory (one decoder layer and a (hidden, 2 * hidden) matrix)
but a checkpoint never loses weights silently, and `mtp.layers.N` must match the config's
`mtp_num_hidden_layers`.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from mili_openai.model.weights import CheckpointError

MTP_PREFIX = "mtp."
MTP_LAYER = re.compile(r"^layers\.(\d+)\.")


class MultiTokenPredictorWeights(nn.Module):
    """Every `mtp.*` tensor as a buffer at its dotted path (containers made as the names need them)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        """tensors: by name relative to `mtp.` (e.g. `fc.weight`)."""
        super().__init__()
        for name, tensor in tensors.items():
            *path, leaf = name.split(".")
            module: nn.Module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_buffer(leaf, tensor)

    @property
    def num_layers(self) -> int:
        layers = getattr(self, "layers", None)
        return 0 if layers is None else len(list(layers.children()))


def take_mtp_weights(tensors: dict[str, torch.Tensor], expected_layers: int) -> MultiTokenPredictorWeights | None:
    """Pop the `mtp.*` tensors out of a checkpoint's; None where it has none. A checkpoint whose MTP layers
    disagree with its config's `mtp_num_hidden_layers` is refused."""
    names = [name for name in tensors if name.startswith(MTP_PREFIX)]
    if not names:
        return None
    relative = {name.removeprefix(MTP_PREFIX): tensors.pop(name) for name in names}
    layers = {int(match.group(1)) for name in relative if (match := MTP_LAYER.match(name))}
    if layers != set(range(expected_layers)):
        raise CheckpointError(f"the checkpoint's MTP weights hold layers {sorted(layers)}, its config's "
                              f"mtp_num_hidden_layers is {expected_layers}")
    return MultiTokenPredictorWeights(relative)
