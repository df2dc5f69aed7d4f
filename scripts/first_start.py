"""How long a new user waits: from `mili serve` on a fresh clone (CPU kernels not built, no model cache) to its
first chat answer, and to its switch onto the compiled kernels.

    python scripts/first_start.py            # clones this checkout's HEAD into a temporary directory

The clone has a path of its own, so its kernel build directory is new (kernels/build_lock.py) and the
start compiles, as a fresh clone's does; the embedded model is built into an empty cache directory. The
server's log goes to stderr's tail when something fails.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

POLL_S = 0.5
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}
SWITCHED = "switched to the compiled CPU kernels"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="mili-first-start-") as scratch:
        clone, cache, log_path = Path(scratch) / "clone", Path(scratch) / "cache", Path(scratch) / "serve.log"
        subprocess.run(["git", "clone", "--quiet", str(repo), str(clone)], check=True)
        port = free_port()
        with open(log_path, "w") as log:
            start = time.monotonic()
            server = subprocess.Popen([sys.executable, "-m", "mili_openai", "serve", "--port", str(port),
                                       "--default-model-cache", str(cache)], cwd=clone, stdout=log, stderr=log,
                                      env={**os.environ, "PYTHONPATH": str(clone)})
            try:
                answered = switched = None
                while time.monotonic() - start < args.timeout and server.poll() is None:
                    if answered is None:
                        try:
                            reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=60)
                            if reply.status_code == 200:
                                answered = time.monotonic() - start
                                print(f"first chat answer after {answered:.1f} s", flush=True)
                        except httpx.TransportError:
                            pass
                    elif SWITCHED in log_path.read_text():
                        switched = time.monotonic() - start
                        print(f"on the compiled CPU kernels after {switched:.1f} s", flush=True)
                        break
                    time.sleep(POLL_S)
            finally:
                server.terminate()
                server.wait()
        lines = [line for line in log_path.read_text().splitlines() if "compiling CPU kernels" in line]
        print("\n".join(lines))
        if answered is None or switched is None:
            print(log_path.read_text()[-4000:], file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
