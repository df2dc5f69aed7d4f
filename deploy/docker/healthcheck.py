"""Docker HEALTHCHECK: exit 0 when the local server's /health answers 200, else 1.

Standard library only, so the slim image needs no curl. The server answers 503 while the model loads
and while it drains after SIGTERM; both count as unhealthy here, which is what `docker ps` should show.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_PORT = "8000"
HEALTH_PATH = "/health"
# Well under the HEALTHCHECK --timeout, so a hung server is reported as unhealthy, not as a timeout.
REQUEST_TIMEOUT_S = 4.0
HTTP_OK = 200


def health_url(environ: dict[str, str]) -> str:
    port = environ.get("MILI_PORT") or DEFAULT_PORT
    if not port.isdigit():
        raise ValueError(f"MILI_PORT must be a port number, got {port!r}")
    return f"http://127.0.0.1:{port}{HEALTH_PATH}"


def is_healthy(url: str, timeout_s: float = REQUEST_TIMEOUT_S) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == HTTP_OK
    except (urllib.error.URLError, OSError):  # HTTPError (503) is a URLError; refused/timeout are OSError
        return False


def main() -> int:
    return 0 if is_healthy(health_url(dict(os.environ))) else 1


if __name__ == "__main__":
    sys.exit(main())
