"""The `mili` command line: flags to config, clean errors, the bench hook, and a real serve + SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from mili_openai import cli
from mili_openai.bench.server_process import free_port
from mili_openai.config import EngineConfig, ServerConfig, SpeculativeConfig

# only a guard against a server that never exits: on a busy 2-core machine (two pytest-xdist workers, other
# builds) importing torch and transformers in the child alone took over 60 s, and a failed load then ~80 s
SERVE_START_TIMEOUT_S = 300.0


def parse(*argv: str):
    return cli.config_from_args(cli.build_parser().parse_args(["serve", *argv]))


def test_defaults_match_the_config_dataclasses():
    config = parse()
    # `mili serve` only serves, and a first start answers while the kernels compile
    assert config == ServerConfig(engine=EngineConfig(cpu_kernels_in_background=True), freeze_gc_after_load=True)


def test_every_flag_reaches_the_config():
    config = parse(
        "/models/qwen", "--host", "0.0.0.0", "--port", "9001", "--api-key", "k", "--served-model-name", "q",
        "--max-model-len", "1024", "--dtype", "float32", "--device", "cpu", "--page-size", "32",
        "--num-pages", "100", "--kv-cache-memory-gb", "1.5", "--gpu-memory-utilization", "0.8",
        "--attention-backend", "torch", "--max-num-batched-tokens", "512", "--tensor-parallel-size", "2",
        "--max-num-seqs", "8", "--max-queue", "10", "--request-timeout", "30", "--max-body-bytes", "4096",
        "--cors-allow-origin", "https://a.example", "--cors-allow-origin", "https://b.example",
        "--shutdown-grace-period", "3", "--num-threads", "2", "--default-model-cache", "/tmp/cache",
        "--log-level", "debug", "--generation-config", "none", "--responses-store-size", "7",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
        "--torch-profiler-dir", "/tmp/profiles", "--max-encoder-patches-per-step", "1024", "--no-kernel-plan-cache",
    )
    assert config == ServerConfig(
        engine=EngineConfig(model="/models/qwen", dtype="float32", device="cpu", page_size=32, num_pages=100,
                            kv_cache_memory_gb=1.5, gpu_memory_utilization=0.8, attention_backend="torch",
                            max_num_batched_tokens=512, max_num_seqs=8, tensor_parallel_size=2,
                            max_model_len=1024, num_threads=2, default_model_cache="/tmp/cache",
                            generation_config="none",
                            speculative_config=SpeculativeConfig(3, prompt_lookup_min=4, prompt_lookup_max=4),
                            cpu_kernels_in_background=True, torch_profiler_dir="/tmp/profiles",
                            max_encoder_patches_per_step=1024, kernel_plan_cache=False),
        host="0.0.0.0", port=9001, api_key="k", served_model_name="q", max_queue=10, request_timeout_s=30.0,
        max_body_bytes=4096, cors_allow_origins=("https://a.example", "https://b.example"), shutdown_grace_s=3.0,
        log_level="debug", freeze_gc_after_load=True, responses_store_size=7,
    )



def test_device_defaults_fill_only_what_is_unset():
    """CPU keeps its defaults; CUDA gets vLLM's batch sizes and leaves the KV pool to the GPU's memory."""
    unset = EngineConfig()
    assert (unset.max_num_seqs, unset.max_num_batched_tokens, unset.kv_cache_memory_gb) == (None, None, None)
    cpu, cuda = unset.for_device("cpu"), unset.for_device("cuda")
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens, cpu.kv_cache_memory_gb) == (64, 512, 2.0)
    assert (cuda.max_num_seqs, cuda.max_num_batched_tokens, cuda.kv_cache_memory_gb) == (256, 8192, None)
    assert cuda.gpu_memory_utilization == 0.9 and cuda.attention_backend == "auto"
    given = EngineConfig(max_num_seqs=8, max_num_batched_tokens=100, kv_cache_memory_gb=1.0).for_device("cuda")
    assert (given.max_num_seqs, given.max_num_batched_tokens, given.kv_cache_memory_gb) == (8, 100, 1.0)
    assert given.for_device("cuda") is given

@pytest.mark.parametrize("argv", [["--page-size", "0"], ["--port", "70000"], ["--max-body-bytes", "10"],
                                  ["--num-threads", "0"], ["--dtype", "int3"], ["--max-model-len", "1"],
                                  ["--generation-config", ""], ["--speculative-config", "{"],
                                  ["--speculative-config", '{"num_speculative_tokens": 0}'],
                                  ["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
                                  ["--speculative-config", '{"num_speculative_tokens": 2, "draft_model": "x"}'],
                                  ["--speculative-config", '[2]'], ["--gpu-memory-utilization", "1.5"],
                                  ["--gpu-memory-utilization", "0"], ["--attention-backend", "flash"],
                                  ["--max-num-seqs", "0"], ["--kv-cache-memory-gb", "0"],
                                  ["--tensor-parallel-size", "0"], ["--max-encoder-patches-per-step", "0"]])
def test_bad_values_are_clean_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_mili_has_serve_and_bench():
    parser = cli.build_parser()
    assert parser.parse_args(["serve"]).func is cli.run_serve
    bench = parser.parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:1"])
    assert bench.command == "bench" and bench.bench_command == "serve"


@pytest.mark.slow  # test_shutdown.py covers the same path (python -m mili_openai serve, SIGTERM mid-stream)
def test_python_m_serve_answers_and_stops_on_sigterm(tiny_checkpoint):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mili_openai", "serve", str(tiny_checkpoint), "--port", str(port),
         "--served-model-name", "tiny", "--dtype", "float32", "--num-pages", "32", "--max-model-len", "256",
         "--shutdown-grace-period", "1", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        banner = proc.stdout.readline()
        assert "'tiny'" in banner and f"127.0.0.1:{port}" in banner
        deadline = time.monotonic() + SERVE_START_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "server never became healthy"
            time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["id"] == "tiny"
        body = {"model": "tiny", "prompt": "in flight", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)  # mid-stream: the stream must still end properly
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        # the draining server handles the signal itself: a clean drain exits 0
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("engine_flags", [[], ["--engine-process"]])
def test_serve_exits_non_zero_when_the_model_fails_to_load(tiny_checkpoint, tmp_path, engine_flags):
    """A server that can never answer should not look alive: it exits 1 so a supervisor restarts it (with
    --engine-process, the engine process's error reaches the server's last line)."""
    broken = tmp_path / "no-weights"
    broken.mkdir()
    for item in tiny_checkpoint.iterdir():
        if item.suffix != ".safetensors":
            (broken / item.name).write_bytes(item.read_bytes())
    proc = subprocess.run(
        [sys.executable, "-m", "mili_openai", "serve", str(broken), "--port", str(free_port()),
         "--dtype", "float32", "--num-pages", "8", "--log-level", "warning", *engine_flags],
        capture_output=True, text=True, timeout=SERVE_START_TIMEOUT_S,
    )
    assert proc.returncode == 1
    [reason] = [line for line in proc.stderr.splitlines() if line.startswith("mili-openai: exiting")]
    assert "the model failed to load: CheckpointError" in reason and ".safetensors" in reason, proc.stderr
