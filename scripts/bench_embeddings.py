"""Embedding throughput: mili's /v1/embeddings vs sentence-transformers' `encode`, side by side in one run, on one
random checkpoint in Qwen3-Embedding-0.6B's shapes (Qwen3-0.6B's body, last-token pooling, normalised).

mili runs as `mili serve CKPT` (a child process); the inputs (`--inputs` of about `--tokens` tokens each) go
to it from `--concurrency` clients, one input per request, as RAG indexers send them. sentence-transformers
encodes the same inputs in batches of `--st-batch` in this process. Both in bf16 on CPU unless `--dtype` says
otherwise. Prints embeddings/s for each and their ratio (the issue's bar: mili >= 3x sentence-transformers).

    .venv/bin/python scripts/bench_embeddings.py                        # 1,000 inputs of ~100 tokens, 16 clients
    .venv/bin/python scripts/bench_embeddings.py --inputs 200 --layers 4  # a quicker look
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

from mili_openai.bench.server_process import LOCALHOST, ServerProcess, ServerSpec, build_cpu_kernels_first, free_port
from mili_openai.model.checkpoint import QWEN3_0_6B_SHAPE, build_random_checkpoint, write_sentence_transformers_files

HEALTH_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 600.0
SEED = 0
WORDS = ("retrieval", "embedding", "vector", "index", "query", "document", "passage", "search", "rank", "token",
         "cache", "model", "server", "latency", "throughput", "batch", "prefix", "page", "tree", "score")


def build_checkpoint(directory: Path, layers: int) -> Path:
    shape = replace(QWEN3_0_6B_SHAPE, num_hidden_layers=layers)
    build_random_checkpoint(directory, shape, SEED)
    return write_sentence_transformers_files(directory, "last", shape.hidden_size)


def make_inputs(count: int, tokens: int) -> list[str]:
    generator = random.Random(SEED)
    # about one token per word for these words; each input differs from its first word on (no shared prefix)
    return [" ".join(generator.choice(WORDS) for _ in range(tokens)) for _ in range(count)]


async def mili_rate(base_url: str, inputs: list[str], concurrency: int) -> float:
    queue = list(inputs)
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
        async def worker() -> None:
            while queue:
                text = queue.pop()
                response = await client.post("/v1/embeddings", json={"input": text})
                response.raise_for_status()

        await client.post("/v1/embeddings", json={"input": inputs[0]})  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(inputs) / (time.perf_counter() - start)


def sentence_transformers_rate(checkpoint: Path, inputs: list[str], batch_size: int, dtype: str) -> float:
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(checkpoint), device="cpu", model_kwargs={"torch_dtype": getattr(torch, dtype)})
    model.encode(inputs[:batch_size], batch_size=batch_size)  # warm-up
    start = time.perf_counter()
    model.encode(inputs, batch_size=batch_size)
    return len(inputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--st-batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B_SHAPE.num_hidden_layers)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()
    inputs = make_inputs(args.inputs, args.tokens)
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = build_checkpoint(Path(scratch) / "qwen3-embedding", args.layers)
        build_cpu_kernels_first()
        port = free_port()
        spec = ServerSpec("mili", (sys.executable, "-m", "mili_openai", "serve", str(checkpoint), "--port", str(port),
                                   "--dtype", args.dtype), f"http://{LOCALHOST}:{port}")
        with ServerProcess(spec, Path(scratch) / "mili.log") as server:
            server.wait_healthy(HEALTH_TIMEOUT_S)
            mili = asyncio.run(mili_rate(spec.base_url, inputs, args.concurrency))
        reference = sentence_transformers_rate(checkpoint, inputs, args.st_batch, args.dtype)
    print(f"{args.inputs} inputs of ~{args.tokens} tokens, {args.layers} layers, {args.dtype}")
    print(f"mili /v1/embeddings, {args.concurrency} clients: {mili:8.1f} embeddings/s")
    print(f"sentence-transformers encode, batch {args.st_batch}: {reference:8.1f} embeddings/s")
    print(f"ratio: {mili / reference:.2f}x")


if __name__ == "__main__":
    main()
