"""Which pooling model a checkpoint is served as (`resolve_pooling`): `--runner`, `--pooling-task` and
`--pooling-type` over what the checkpoint says (a sentence-transformers `modules.json`, model/pooling_config.py).

- `--runner auto` pools where the checkpoint has a sentence-transformers Pooling module (Qwen3-Embedding does),
  and generates otherwise; `--runner pooling` pools any Qwen checkpoint.
- `--pooling-task rerank` serves a Qwen3-Reranker: its checkpoint is a plain Qwen3ForCausalLM, so nothing in
  it says so; the score is P("yes") over ("no", "yes") at the last token of its prompt (engine/pooler.py).
- A `Qwen3ForSequenceClassification` checkpoint (model/classifier_config.py) only pools: its score head gives
  each input's label probabilities (task classify), and with one label, a pair's score (a converted reranker).
- Pooling: `--pooling-type`, else the checkpoint's, else the last token (Qwen3-Embedding's; vLLM's default for
  decoder models). Vectors are L2-normalised unless the checkpoint's modules leave out Normalize.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mili_openai.config import EngineConfig
from mili_openai.engine.pooling_spec import CLASSIFY, EMBED, LAST, RERANK, PoolingSpec
from mili_openai.model import ModelConfig
from mili_openai.model.classifier_config import SEQUENCE_CLASSIFICATION
from mili_openai.model.pooling_config import read_checkpoint_pooling

RERANK_TOKENS = ("no", "yes")  # the answers Qwen3-Reranker's prompt asks for, in the order the score reads them


def resolve_pooling(config: EngineConfig, model_path: Path | None, model_config: ModelConfig,
                    tokenizer: Any) -> PoolingSpec | None:
    """The pooling model to serve, or None to generate. ValueError for a combination that cannot run."""
    checkpoint = read_checkpoint_pooling(model_path) if model_path is not None else None
    classifier = model_config.classifier
    says_pooling = checkpoint is not None or classifier is not None
    pooling = config.runner == "pooling" or (config.runner == "auto" and says_pooling)
    if not pooling:
        if classifier is not None:
            raise ValueError(f"a {SEQUENCE_CLASSIFICATION} checkpoint has a score head and no LM head: it does not "
                             "generate; serve it with --runner pooling (or auto)")
        if config.pooling_task != "auto" or config.pooling_type is not None:
            raise ValueError("--pooling-task and --pooling-type apply to a pooling model (--runner pooling)")
        return None
    if classifier is not None:
        if config.pooling_task not in ("auto", CLASSIFY) or config.pooling_type not in (None, LAST):
            raise ValueError(f"a {SEQUENCE_CLASSIFICATION} checkpoint classifies the last token with its own head: "
                             f"--pooling-task must be auto or {CLASSIFY}, and --pooling-type last or unset")
        return PoolingSpec(CLASSIFY, LAST, normalize=False, hidden_size=model_config.hidden_size,
                           labels=classifier.labels, activation=classifier.activation)
    if config.pooling_task == CLASSIFY:
        raise ValueError(f"--pooling-task {CLASSIFY} needs a {SEQUENCE_CLASSIFICATION} checkpoint (a score head)")
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
