"""Which pooling model a checkpoint is served as (`resolve_pooling`): `--runner`, `--pooling-task` and
`--pooling-type` over what the checkpoint says (a sentence-transformers `modules.json`, model/pooling_config.py).

- `--runner auto` pools where the checkpoint has a sentence-transformers Pooling module (Qwen3-Embedding does),
  and generates otherwise; `--runner pooling` pools any Qwen checkpoint.
- `--pooling-task rerank` serves a Qwen3-Reranker: its checkpoint is a plain Qwen3ForCausalLM, so nothing in
  it says so; the score is P("yes") over ("no", "yes") at the last token of its prompt (engine/pooler.py).
- Pooling: `--pooling-type`, else the checkpoint's, else the last token (Qwen3-Embedding's; vLLM's default for
  decoder models). Vectors are L2-normalised unless the checkpoint's modules leave out Normalize.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mili_openai.config import EngineConfig
from mili_openai.engine.pooling_spec import EMBED, LAST, RERANK, PoolingSpec
from mili_openai.model import ModelConfig
from mili_openai.model.pooling_config import read_checkpoint_pooling

RERANK_TOKENS = ("no", "yes")  # the answers Qwen3-Reranker's prompt asks for, in the order the score reads them


def resolve_pooling(config: EngineConfig, model_path: Path | None, model_config: ModelConfig,
                    tokenizer: Any) -> PoolingSpec | None:
    """The pooling model to serve, or None to generate. ValueError for a combination that cannot run."""
    checkpoint = read_checkpoint_pooling(model_path) if model_path is not None else None
    pooling = config.runner == "pooling" or (config.runner == "auto" and checkpoint is not None)
    if not pooling:
        if config.pooling_task != "auto" or config.pooling_type is not None:
            raise ValueError("--pooling-task and --pooling-type apply to a pooling model (--runner pooling)")
        return None
    task = RERANK if config.pooling_task == RERANK else EMBED
    if task == RERANK:
        if config.pooling_type not in (None, LAST):
            raise ValueError("a reranker scores the last token: --pooling-type must be last")
        return PoolingSpec(RERANK, LAST, normalize=False, hidden_size=model_config.hidden_size,
                           score_token_ids=tuple(_single_token(tokenizer, word) for word in RERANK_TOKENS))
    pooling_type = config.pooling_type or (checkpoint.pooling_type if checkpoint is not None else LAST)
    normalize = checkpoint.normalize if checkpoint is not None else True
    return PoolingSpec(EMBED, pooling_type, normalize, hidden_size=model_config.hidden_size)


def _single_token(tokenizer: Any, word: str) -> int:
    ids = tokenizer.convert_tokens_to_ids([word])
    if len(ids) != 1 or ids[0] is None or ids[0] == tokenizer.unk_token_id:
        raise ValueError(f"a reranker scores the token {word!r}, which this tokenizer does not have as one token")
    return int(ids[0])
