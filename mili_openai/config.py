"""One configuration dataclass tree, built once by the CLI (or the offline `LLM`) and passed down.

Nothing else in the package reads the environment or keeps mutable module state; every knob lives here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "bfloat16", "float16", "float32")
DEVICES = ("auto", "cpu", "cuda")
# Default token budget per forward. A step's prefill chunk stalls every running stream until it ends: on
# a 2-core CPU 512 tokens take ~2.5 s (2048 took ~10 s, all of it added to each stream's inter-token
# gap), and matmuls are already at full speed from a few hundred rows. GPUs finish 2048 in milliseconds.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # local checkpoint dir or hub id; None = the embedded default model
    dtype: str = "auto"  # auto = bfloat16 (the dtype Qwen3 checkpoints ship in)
    device: str = "auto"  # auto = cuda when available, else cpu
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # explicit pool size; overrides kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0  # pool budget when num_pages is not given
    # token budget of one forward (decode tokens + prefill chunks); None = the device's default
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64  # cap on running sequences
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    seed: int = 0  # seed of the unseeded sampling stream
    default_model_cache: str | None = None  # where the embedded default model is built; None = ~/.cache/mili-openai
    # where requests' omitted sampling fields come from: "auto" = the model's generation_config.json,
    # "none" = OpenAI's defaults, or a directory holding a generation_config.json (as vLLM's flag)
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be > 0")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if not self.generation_config:
            raise ValueError("generation_config must be 'auto', 'none' or a directory")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # None = the model path's last component
    max_queue: int = 1024  # waiting requests beyond this get 429
    request_timeout_s: float = 600.0  # a request running longer is aborted with finish_reason "abort"
    max_body_bytes: int = 8 * 1024 * 1024
    cors_allow_origins: tuple[str, ...] = ()  # empty = CORS off
    shutdown_grace_s: float = 30.0  # in-flight requests get this long to finish on SIGTERM
    log_level: str = "info"
    debug_endpoints: bool = False  # serve GET /debug/engine (page accounting) for soak tests; never in production

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")
