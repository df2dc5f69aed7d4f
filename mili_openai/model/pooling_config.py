"""What a sentence-transformers checkpoint says about pooling: `modules.json` lists its modules (a Transformer,
then a Pooling module whose folder holds `config.json`, maybe a Normalize), as Qwen3-Embedding ships them.
Only the modules an embedding server can honour are accepted: a Dense projection or an unknown module is
refused at start, naming it, rather than served wrong."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MODULES_FILE = "modules.json"
MODULE_PREFIX = "sentence_transformers.models."
TRANSFORMER, POOLING, NORMALIZE = "Transformer", "Pooling", "Normalize"
# 1_Pooling/config.json's flags -> our pooling types (engine/pooling_spec.py's names)
POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                     "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True, slots=True)
class CheckpointPooling:
    pooling_type: str  # "last", "mean" or "cls"
    normalize: bool  # a Normalize module follows the pooling


def read_checkpoint_pooling(path: str | Path) -> CheckpointPooling | None:
    """The checkpoint's sentence-transformers pooling; None without a `modules.json` naming a Pooling module.
    ValueError names a module or pooling mode this server cannot run."""
    directory = Path(path)
    modules_file = directory / MODULES_FILE
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    kinds = [(str(module.get("type", "")).removeprefix(MODULE_PREFIX), module.get("path", "")) for module in modules]
    pooling_dirs = [folder for kind, folder in kinds if kind == POOLING]
    if not pooling_dirs:
        return None
    unknown = [kind for kind, _ in kinds if kind not in (TRANSFORMER, POOLING, NORMALIZE)]
    if unknown:
        raise ValueError(f"{modules_file} lists sentence-transformers modules this server does not run: {unknown}")
    pooling_file = directory / pooling_dirs[0] / "config.json"
    fields = json.loads(pooling_file.read_text()) if pooling_file.is_file() else {}
    asked = [name for name in (*POOLING_MODES, *UNSUPPORTED_MODES) if fields.get(name)]
    if len(asked) != 1 or asked[0] not in POOLING_MODES:
        raise ValueError(f"{pooling_file} asks for pooling {asked or 'none'}; this server pools by exactly one of "
                         f"{sorted(POOLING_MODES)}")
    return CheckpointPooling(POOLING_MODES[asked[0]], normalize=any(kind == NORMALIZE for kind, _ in kinds))
