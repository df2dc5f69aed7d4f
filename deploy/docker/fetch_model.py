"""Init-container job: download a Hugging Face hub checkpoint into the model volume, once.

    python3 /opt/mili/fetch_model.py --repo-id Qwen/Qwen3-0.6B --local-dir /models/Qwen3-0.6B

Runs before the server (which then mounts the volume read-only). A directory that already holds a
`config.json` is taken as complete and left alone, so restarts and extra replicas cost nothing. The
download goes to a sibling `*.partial` directory that is renamed into place only when complete:
a pod killed mid-download never leaves a half checkpoint that would look finished next time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

COMPLETE_MARKER = "config.json"
PARTIAL_SUFFIX = ".partial"
# What serving needs; skips the .bin/.pth duplicates and ONNX/GGUF variants some repos also carry.
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken")

Downloader = Callable[..., str]


def is_complete(local_dir: Path) -> bool:
    return (local_dir / COMPLETE_MARKER).is_file()


def fetch(repo_id: str, local_dir: Path, revision: str | None, download: Downloader) -> bool:
    """Download `repo_id` into `local_dir` unless it is already there; True when it downloaded."""
    if not repo_id or repo_id.count("/") != 1:
        raise ValueError(f"repo id must look like 'owner/name', got {repo_id!r}")
    if is_complete(local_dir):
        return False
    partial = local_dir.with_name(local_dir.name + PARTIAL_SUFFIX)
    # Kept across attempts on purpose: the hub client resumes files already in `partial`.
    download(repo_id=repo_id, revision=revision, local_dir=str(partial), allow_patterns=list(ALLOW_PATTERNS))
    if not is_complete(partial):
        raise ValueError(f"{repo_id} has no {COMPLETE_MARKER}: not a transformers checkpoint")
    if local_dir.exists():  # an earlier incomplete copy, e.g. from a manual cp
        shutil.rmtree(local_dir)
    os.replace(partial, local_dir)
    return True


def hub_downloader() -> Downloader:
    from huggingface_hub import snapshot_download  # deferred: only the download path needs it

    return snapshot_download


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo-id", required=True, help="hub id, e.g. Qwen/Qwen3-0.6B")
    parser.add_argument("--local-dir", required=True, type=Path, help="checkpoint directory on the model volume")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    args = parser.parse_args(argv)
    try:
        downloaded = fetch(args.repo_id, args.local_dir, args.revision or None, hub_downloader())
    except ValueError as exc:
        parser.error(str(exc))
    state = "downloaded" if downloaded else "already present"
    print(f"fetch_model: {args.repo_id} {state} at {args.local_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
