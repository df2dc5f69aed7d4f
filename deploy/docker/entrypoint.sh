#!/bin/sh
# Container entrypoint: turns the image's environment into a `mili serve` command line.
#
# Environment (all optional):
#   MILI_MODEL      checkpoint directory (e.g. /models/Qwen3-0.6B on a mounted volume) or hub id
#                   (fetched at start into $HF_HOME); empty = the embedded random-weight model
#   MILI_HOST       bind address (image default 0.0.0.0)
#   MILI_PORT       port (image default 8000)
#   MILI_CACHE_DIR  writable cache root; the embedded model is built under it (image default /var/cache/mili)
#   MILI_API_KEY    when set, clients must send `Authorization: Bearer $MILI_API_KEY`
# Arguments that start with "-" are appended as further `mili serve` flags; any other first argument is
# run as a command instead (e.g. `docker run IMAGE sh`).
#
# `exec` makes the server PID 1's replacement, so SIGTERM from `docker stop` / the kubelet reaches it
# directly and the drain (health 503, finish in-flight requests) happens instead of a hard kill.
set -eu

if [ "$#" -gt 0 ] && [ "${1#-}" = "$1" ]; then
    exec "$@"
fi

if [ -n "${MILI_API_KEY:-}" ]; then
    set -- --api-key "${MILI_API_KEY}" "$@"
fi
set -- \
    --host "${MILI_HOST:-0.0.0.0}" \
    --port "${MILI_PORT:-8000}" \
    --default-model-cache "${MILI_CACHE_DIR:-/var/cache/mili}/default-model" \
    "$@"
if [ -n "${MILI_MODEL:-}" ]; then
    set -- "${MILI_MODEL}" "$@"
fi
exec mili serve "$@"
