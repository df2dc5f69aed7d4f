"""One configuration dataclass tree, built once by the CLI (or the offline `LLM`) and passed down.

Nothing else in the package reads the environment or keeps mutable module state; every knob lives here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

DTYPES = ("auto", "bfloat16", "float16", "float32")
DEVICES = ("auto", "cpu", "cuda")
# Default token budget per forward. A step's prefill chunk stalls every running stream until it ends, and
# on a 2-core CPU a larger chunk adds seconds to every stream's inter-token gap for little throughput. On
# CUDA, vLLM's: a GPU finishes thousands of tokens in milliseconds, and a large budget fills it.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 512, "cuda": 8192}
DEFAULT_MAX_NUM_SEQS = {"cpu": 64, "cuda": 256}  # running sequences; on CUDA vLLM's default
# image patches a step may encode: about five 448 x 448 images (784 patches of 16 x 16 each), or one 1024 x 1024
DEFAULT_MAX_ENCODER_PATCHES = 4096
DEFAULT_ENGINE_PROCESS = {"cpu": False, "cuda": True}  # the server's engine in a process of its own
DEFAULT_ASYNC_LAUNCH = {"cpu": False, "cuda": True}  # steps launched on the engine loop (see EngineConfig)
DEFAULT_CPU_KV_CACHE_MEMORY_GB = 2.0  # on CUDA the pool takes what gpu_memory_utilization leaves
# speculative disable_by_batch_size "auto": CUDA none (vLLM's); a CPU 4, where a few decodes are compute-bound
DEFAULT_DISABLE_BY_BATCH_SIZE = {"cpu": 4, "cuda": None}
SPECULATIVE_DEVICE_DEFAULT = "auto"
# "auto": Triton page-table kernels on CUDA, the compiled CPU kernels on CPU; "triton": Triton (CUDA, or the
# CPU under TRITON_INTERPRET=1 for tests); "torch": torch's SDPA over gathered K/V on CUDA
ATTENTION_BACKENDS = ("auto", "triton", "torch")


SPECULATIVE_METHODS = ("ngram", "mtp", "draft_model")
MTP_SPECULATIVE_METHOD = "mtp"  # the checkpoint's own multi-token-prediction module (Qwen3.5 / Qwen3-Next)
DRAFT_MODEL_SPECULATIVE_METHOD = "draft_model"  # a smaller checkpoint sharing the target's tokenizer
# weights quantized as a bf16 checkpoint loads (model/quantization): int8 and int4 on CPU and CUDA, fp8 on CUDA
QUANTIZATION_METHODS = ("int8", "int4", "fp8")
QUANTIZATION_GROUP_SIZES = (32, 64, 128)  # int4: values along a row per scale and zero point
LM_HEAD_QUANTIZATIONS = ("int8", "int4")  # under int8 or int4 weights; int8 (a scale per row) unless chosen
# tool-call formats, by vLLM's parser names: Qwen3's JSON, and the XML of Qwen3.5 / Qwen3.6 / Qwen3-Coder
HERMES_TOOL_PARSER, XML_TOOL_PARSER = "hermes", "qwen3_coder"
# what the engine serves (vLLM's `--runner`): auto = pooling where the checkpoint has a sentence-transformers
# Pooling module, else generation; and a pooling model's task and pooling (engine/pooling_setup.py)
RUNNERS = ("auto", "generate", "pooling")
POOLING_TASKS = ("auto", "embed", "rerank", "classify")
POOLING_TYPES = ("last", "mean", "cls")
RERANK_TEMPLATE_FIELDS = ("{query}", "{document}")  # what a --rerank-template must place ({instruction}: optional)
TOOL_CALL_PARSERS = (HERMES_TOOL_PARSER, XML_TOOL_PARSER)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's `--speculative-config`: each decode step proposes up to
    `num_speculative_tokens` draft tokens and the model verifies them all in that one forward.

    "ngram" (prompt lookup) drafts the tokens that followed the longest earlier occurrence of the
    sequence's last n tokens, n in [prompt_lookup_min, prompt_lookup_max]. vLLM's defaults: an unset
    bound takes the other's value, and both unset are 5.

    Drafts pay where a decode step is bound by reading the weights, which one step reads once for all
    its rows; in a large batch the step is bound by compute, and rows for rejected drafts slow it. So,
    as vLLM's key of that name, steps with more running sequences than `disable_by_batch_size` decode
    without drafts ("auto": the device's DEFAULT_DISABLE_BY_BATCH_SIZE, set by `EngineConfig.for_device`).

    "mtp" drafts with the checkpoint's own multi-token-prediction module (Qwen3.5 / Qwen3.6 / Qwen3-Next),
    chained for more than one token; "draft_model" with `model`, a smaller Qwen3 / Qwen3.5 checkpoint that
    shares the target's tokenizer, run autoregressively. As vLLM, `method` left out is "draft_model" where
    `model` is given, else "ngram". A request whose drafts are mostly rejected pauses its drafting (DraftSwitch,
    engine/proposers.py). `token_map` (SGLang's `--speculative-token-map`) restricts a model's drafts to a
    file's token ids, so each draft reads only their rows of the LM head.
    """

    num_speculative_tokens: int
    method: str | None = None  # None: "draft_model" where `model` is given, else "ngram"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # "auto" (SPECULATIVE_DEVICE_DEFAULT) = the device's default; None = draft at every batch size
    disable_by_batch_size: int | str | None = SPECULATIVE_DEVICE_DEFAULT
    model: str | None = None  # the draft checkpoint of method "draft_model"
    min_acceptance_rate: float = 0.2
    min_drafts_for_switch: int = 4
    switch_backoff_tokens: int = 128
    token_map: str | None = None  # "mtp" / "draft_model": a JSON list of the token ids drafts are drawn from

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", DRAFT_MODEL_SPECULATIVE_METHOD if self.model else "ngram")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if not _is_count(self.num_speculative_tokens):
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {self.num_speculative_tokens!r}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        elif low is None:
            low = high
        elif high is None:
            high = low
        if not (_is_count(low) and _is_count(high) and low <= high):
            raise ValueError(f"prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max, "
                             f"got {self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}")
        if (limit := self.disable_by_batch_size) not in (None, SPECULATIVE_DEVICE_DEFAULT) and not _is_count(limit):
            raise ValueError(f'disable_by_batch_size must be an integer >= 1, null (draft at every batch size) or '
                             f'"{SPECULATIVE_DEVICE_DEFAULT}" (the device\'s default), got {limit!r}')
        if not 0 <= self.min_acceptance_rate <= 1:
            raise ValueError(f"min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate!r}")
        if not _is_count(self.min_drafts_for_switch):
            raise ValueError(f"min_drafts_for_switch must be an integer >= 1, got {self.min_drafts_for_switch!r}")
        if not _is_count(self.switch_backoff_tokens, least=0):
            raise ValueError(f"switch_backoff_tokens must be an integer >= 0, got {self.switch_backoff_tokens!r}")
        if self.token_map is not None and self.method not in (MTP_SPECULATIVE_METHOD, DRAFT_MODEL_SPECULATIVE_METHOD):
            raise ValueError(f'speculative token_map is for a model\'s drafts ("mtp", "draft_model"), not '
                             f'"{self.method}"')
        if self.method == DRAFT_MODEL_SPECULATIVE_METHOD and not self.model:
            raise ValueError('speculative method "draft_model" needs "model": the draft checkpoint\'s path')
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """LoRA adapters served beside the base model, as vLLM's `--enable-lora` flags: each request picks one by
    naming it as its `model`. `modules`: (name, PEFT adapter directory) pairs, each checked at start.
    `max_loras`: adapters in one step (each a slot on the device); `max_cpu_loras`: adapters kept loaded on the
    host (None = max_loras); `max_lora_rank`: the largest rank an adapter may have (sizes the slots)."""

    modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple((str(name), str(path)) for name, path in self.modules))
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"LoRA adapter names must be distinct and non-empty, got {names}")
        for field_name in ("max_loras", "max_lora_rank"):
            if not _is_count(getattr(self, field_name)):
                raise ValueError(f"{field_name} must be an integer >= 1, got {getattr(self, field_name)!r}")
        if self.max_cpu_loras is not None and not (_is_count(self.max_cpu_loras) and self.max_cpu_loras >= self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")

    @property
    def cpu_capacity(self) -> int:
        """Adapters kept loaded on the host."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def _is_count(value, least: int = 1) -> bool:
    """An int >= least, and not a bool (JSON `true` would pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # local checkpoint dir or hub id; None = the embedded default model
    dtype: str = "auto"  # auto = bfloat16 (the dtype Qwen3 checkpoints ship in)
    device: str = "auto"  # auto = cuda when available, else cpu
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # explicit pool size; overrides kv_cache_memory_gb
    # pool budget when num_pages is not given; None = 2 GB on CPU, on CUDA what gpu_memory_utilization leaves
    kv_cache_memory_gb: float | None = None
    # CUDA: the share of the GPU's memory this engine may fill: weights, the peak activation of a forward
    # at max_num_batched_tokens (profiled at start) and the KV pool, which takes the rest (vLLM's flag)
    gpu_memory_utilization: float = 0.9
    # token budget of one forward (decode tokens + prefill chunks); None = the device's default
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None  # cap on running sequences; None = the device's default
    # vision models: the image patches one step may encode (engine/encoder_budget.py); one image always fits
    max_encoder_patches_per_step: int = DEFAULT_MAX_ENCODER_PATCHES
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # a hybrid model's prefix cache keeps state snapshots (engine/state_snapshots.py) in this share of the cache
    # budget (the rest: KV pages and the running sequences' state slots; None: two per running sequence, from 0.2
    # up to half of what their slots leave, engine/memory_budget.py), or exactly num_hybrid_snapshots of them; a
    # prefill also saves its state every hybrid_snapshot_interval pages (None: only where needed)
    hybrid_snapshot_fraction: float | None = None
    num_hybrid_snapshots: int | None = None
    hybrid_snapshot_interval: int | None = None
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    seed: int = 0  # seed of the unseeded sampling stream
    default_model_cache: str | None = None  # where the embedded default model is built; None = ~/.cache/mili-openai
    # where requests' omitted sampling fields come from: "auto" = the model's generation_config.json,
    # "none" = OpenAI's defaults, or a directory holding a generation_config.json (as vLLM's flag)
    generation_config: str = "auto"
    speculative_config: SpeculativeConfig | None = None  # None = no speculative decoding
    enforce_eager: bool = False  # CUDA: run decode steps op by op instead of from CUDA graphs (vLLM's flag)
    attention_backend: str = "auto"  # which attention kernels run (ATTENTION_BACKENDS)
    # worker processes that each hold a shard of the model (one GPU each on CUDA); 1 = the model runs in the
    # engine process itself (engine/tp_forward.py)
    tensor_parallel_size: int = 1
    # None = the checkpoint's own weights (quantized ones as config.json's quantization_config declares)
    quantization: str | None = None
    quantization_group_size: int = 128  # int4's group
    # the LM head's (and a tied embedding's) weights under int8/int4: None = int8, "int4" = groups of
    # quantization_group_size with zero points, as the layers
    quantize_lm_head: str | None = None
    # CPU: when the compiled kernels are not built yet (a first start), serve on torch's ops while they compile
    # on a thread, and switch to them between steps once no request runs (`mili serve` sets it; off, the load
    # waits for the compile)
    cpu_kernels_in_background: bool = False
    # CPU: read the kernel plan (which kernel runs which shape, timed in seconds at a first start) that an earlier
    # start on this machine kept beside the kernels' build, and keep a newly timed one there (kernels/plan_cache.py)
    kernel_plan_cache: bool = True
    # the server: run the engine (scheduling, step inputs, postprocessing) in a process of its own, off the HTTP
    # side's event loop and GIL (engine/process_client.py); None = the device's default (DEFAULT_ENGINE_PROCESS).
    # The offline `LLM` runs the engine in the caller's process whatever this says
    engine_process: bool | None = None
    # the engine loop launches each step (queues it on the GPU) a step ahead, with its pending tokens fed on the
    # device, and a worker thread only waits for each step's results: the GPU runs one step while the host
    # postprocesses the one before. None = the device's default (DEFAULT_ASYNC_LAUNCH); True on CPU runs the
    # forward on the loop thread (for tests of this path: slower there). Tensor parallelism runs without it
    async_launch: bool | None = None
    # CPython's GIL switch interval (sys.setswitchinterval) for the engine's process, set when its engine
    # starts; None = leave Python's (5 ms). A thread waiting for the GIL waits up to this long
    switch_interval_s: float | None = None
    # where POST /stop_profile writes a torch profile of the engine's steps (a Chrome trace and a text summary);
    # None = profiling off, and the profile routes answer 404 (vLLM's torch profiler directory)
    torch_profiler_dir: str | None = None
    runner: str = "auto"  # RUNNERS: generate text, or pool (embeddings, rerank scores); auto reads the checkpoint
    # POOLING_TASKS: auto = embed (classify for a Qwen3ForSequenceClassification); rerank serves a Qwen3-Reranker
    pooling_task: str = "auto"
    pooling_type: str | None = None  # POOLING_TYPES; None = the checkpoint's (modules.json), else last
    lora: LoraConfig | None = None  # None = no adapters (vLLM's --enable-lora off)

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # as the offline LLM(lora={...}) takes it
            object.__setattr__(self, "lora", LoraConfig(**self.lora))
        if isinstance(self.speculative_config, dict):  # as the offline LLM(speculative_config={...}) takes it
            object.__setattr__(self, "speculative_config", speculative_config_from(self.speculative_config))
        if not isinstance(self.speculative_config, SpeculativeConfig | None):
            raise ValueError("speculative_config must be a SpeculativeConfig, a dict of its fields, or None")
        if (self.speculative_config is not None and self.tensor_parallel_size > 1
                and self.speculative_config.method == DRAFT_MODEL_SPECULATIVE_METHOD):
            raise ValueError('speculative method "draft_model" does not run under tensor parallelism yet')
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.switch_interval_s is not None and not self.switch_interval_s > 0:
            raise ValueError(f"switch_interval_s must be > 0, got {self.switch_interval_s}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if not _is_count(self.max_encoder_patches_per_step):
            raise ValueError(f"max_encoder_patches_per_step must be an integer >= 1, "
                             f"got {self.max_encoder_patches_per_step!r}")
        if self.hybrid_snapshot_fraction is not None and not 0 <= self.hybrid_snapshot_fraction < 1:
            raise ValueError(f"hybrid_snapshot_fraction must be in [0, 1), got {self.hybrid_snapshot_fraction}")
        if self.num_hybrid_snapshots is not None and self.num_hybrid_snapshots < 0:
            raise ValueError("num_hybrid_snapshots must be >= 0")
        if self.hybrid_snapshot_interval is not None and not _is_count(self.hybrid_snapshot_interval):
            raise ValueError(f"hybrid_snapshot_interval must be an integer >= 1 (pages), "
                             f"got {self.hybrid_snapshot_interval!r}")
        if self.torch_profiler_dir is not None and not self.torch_profiler_dir.strip():
            raise ValueError("torch_profiler_dir must name a directory")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.pooling_task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be one of {POOLING_TASKS}, got {self.pooling_task!r}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if not _is_count(self.tensor_parallel_size):
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if not self.generation_config:
            raise ValueError("generation_config must be 'auto', 'none' or a directory")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
        if self.quantization_group_size not in QUANTIZATION_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {QUANTIZATION_GROUP_SIZES}, "
                             f"got {self.quantization_group_size!r}")
        if self.quantize_lm_head is not None:
            if self.quantize_lm_head not in LM_HEAD_QUANTIZATIONS:
                raise ValueError(f"quantize_lm_head must be one of {LM_HEAD_QUANTIZATIONS}, "
                                 f"got {self.quantize_lm_head!r}")
            if self.quantization not in LM_HEAD_QUANTIZATIONS:
                raise ValueError("quantize_lm_head applies to --quantization int8 or int4")

    def for_device(self, device_type: str) -> EngineConfig:
        """This config with the defaults that depend on the device ("cpu" or "cuda") filled in; what is set
        stays. On CUDA the KV pool's size stays unset unless given: the runner sizes it from the GPU."""
        defaults = {}
        if self.max_num_batched_tokens is None:
            defaults["max_num_batched_tokens"] = DEFAULT_MAX_NUM_BATCHED_TOKENS[device_type]
        if self.max_num_seqs is None:
            defaults["max_num_seqs"] = DEFAULT_MAX_NUM_SEQS[device_type]
        if self.engine_process is None:
            defaults["engine_process"] = DEFAULT_ENGINE_PROCESS[device_type]
        if self.async_launch is None:
            defaults["async_launch"] = DEFAULT_ASYNC_LAUNCH[device_type]
        if self.kv_cache_memory_gb is None and device_type != "cuda":
            defaults["kv_cache_memory_gb"] = DEFAULT_CPU_KV_CACHE_MEMORY_GB
        speculative = self.speculative_config
        if speculative is not None and speculative.disable_by_batch_size == SPECULATIVE_DEVICE_DEFAULT:
            defaults["speculative_config"] = dataclasses.replace(
                speculative, disable_by_batch_size=DEFAULT_DISABLE_BY_BATCH_SIZE[device_type])
        return dataclasses.replace(self, **defaults) if defaults else self


@dataclass(frozen=True, slots=True)
class MediaConfig:
    """Limits on the images a request may carry (protocol/image_loading.py). http(s) image URLs are fetched only
    from `allowed_domains` (vLLM's --allowed-media-domains); empty, as by default, allows data URLs only."""

    allowed_domains: tuple[str, ...] = ()
    max_images_per_request: int = 8
    max_image_bytes: int = 16 * 1024 * 1024  # encoded, as sent or fetched
    max_image_pixels: int = 64 * 1024 * 1024  # decoded width x height, checked before the pixels are decoded
    fetch_timeout_s: float = 10.0  # an image URL's whole fetch

    def __post_init__(self) -> None:
        if self.max_images_per_request < 0 or self.max_image_bytes < 1 or self.max_image_pixels < 1:
            raise ValueError("image limits must be positive (max_images_per_request may be 0: no images)")
        if self.fetch_timeout_s <= 0:
            raise ValueError("the image fetch timeout must be > 0")


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
    # An idle keep-alive connection is closed after this long. Well above the 5 s of httpx's pool (the openai
    # SDK's, LangChain's...): a server that idles out first races the client's reuse of the connection, and
    # the request sent into the closing socket is lost. Load balancers in front must idle out before it.
    timeout_keep_alive_s: int = 75
    log_level: str = "info"
    # POST /v1/responses answers kept for previous_response_id and GET /v1/responses/{id}: the latest this
    # many, in this process's memory (per replica); 0 keeps none
    responses_store_size: int = 1024
    debug_endpoints: bool = False  # serve GET /debug/engine (page accounting) for soak tests; never in production
    # Move every object alive once the model has loaded out of the garbage collector's reach (gc.freeze),
    # as vLLM does after start-up: a full collection over them stalls the process. For a process
    # that only serves (`mili serve` sets it); off by default, as it freezes whatever else the process holds.
    freeze_gc_after_load: bool = False
    # the format tool calls are parsed in (TOOL_CALL_PARSERS); None = the one the model's chat template teaches
    tool_call_parser: str | None = None
    media: MediaConfig = field(default_factory=MediaConfig)  # what images a request may carry
    # a reranker's prompt for one pair, with {query}, {document} and optionally {instruction}; None = the
    # Qwen3-Reranker model card's (protocol/scoring.py)
    rerank_template: str | None = None
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the served adapters (vLLM's runtime LoRA
    # updating); off, both answer 404. Needs engine.lora (--enable-lora)
    runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if self.runtime_lora_updating and self.engine.lora is None:
            raise ValueError("runtime LoRA updating needs LoRA adapters enabled (--enable-lora)")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.rerank_template is not None and not all(f in self.rerank_template for f in RERANK_TEMPLATE_FIELDS):
            raise ValueError(f"the rerank template must contain {' and '.join(RERANK_TEMPLATE_FIELDS)}")
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
        if self.timeout_keep_alive_s < 1:
            raise ValueError("timeout_keep_alive_s must be >= 1")
        if self.responses_store_size < 0:
            raise ValueError("responses_store_size must be >= 0")


def speculative_config_from(fields: dict) -> SpeculativeConfig:
    """vLLM's `--speculative-config` object (a dict of its JSON) -> SpeculativeConfig; ValueError names
    what is wrong."""
    if not isinstance(fields, dict):
        raise ValueError("the speculative config must be a JSON object")
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
             "model", "min_acceptance_rate", "min_drafts_for_switch", "switch_backoff_tokens", "token_map"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unsupported speculative config keys {unknown}; this server takes {sorted(known)}")
    if "num_speculative_tokens" not in fields:
        raise ValueError("the speculative config needs num_speculative_tokens")
    return SpeculativeConfig(**fields)
