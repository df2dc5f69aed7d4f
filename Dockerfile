# syntax=docker/dockerfile:1
# mili-openai server image. CPU build (default):
#   docker build -t mili-openai:0.1.0 .
# CUDA build (the CUDA torch wheels bundle the CUDA runtime; the host's driver comes in through the
# NVIDIA container toolkit, so the slim Python base is enough):
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                --build-arg CPU_KERNEL_TOOLCHAIN=0 -t mili-openai:0.1.0-cuda .
# An NVIDIA CUDA base works as well (Python is installed into it when missing):
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                --build-arg CPU_KERNEL_TOOLCHAIN=0 -t mili-openai:0.1.0-cuda .
# See docs/deployment.md.

ARG BASE_IMAGE=python:3.12-slim-bookworm

# ---- builder: a virtualenv with torch (pinned, from the chosen index) and the package ----
FROM ${BASE_IMAGE} AS builder
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG NINJA_VERSION=1.13.2

# CUDA base images ship without Python. The version is whatever the base distribution ships, so a
# package pin would only break when the archive moves on.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi

ENV VIRTUAL_ENV=/opt/venv \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv "${VIRTUAL_ENV}"
ENV PATH="${VIRTUAL_ENV}/bin:${PATH}"

# torch first and pinned, from its own index: left to the resolver it would pull the multi-GB
# default (CUDA) build from PyPI into a CPU image. Its own layer, so code edits do not re-download it.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY mili_openai ./mili_openai
# torch is already satisfied, so this adds only the package and its light dependencies; ninja is what
# torch's JIT needs to build the bf16 CPU decode kernel at first start. The check fails the build when
# the wheel lacks the kernel source (it would otherwise fall back to slower torch matmuls silently).
RUN pip install --no-cache-dir . "ninja==${NINJA_VERSION}" \
    && python -c "import torch; from mili_openai.kernels.cpu import HEADERS, QUANTIZED_SOURCES, SOURCE_DIR, SOURCES; \
missing = [s for s in SOURCES + QUANTIZED_SOURCES + HEADERS if not (SOURCE_DIR / s).is_file()]; \
assert not missing, f'{missing} missing from the installed package'; print('torch', torch.__version__)"

# ---- runtime: the virtualenv, three small scripts, a non-root user; no pip cache or build tree ----
FROM ${BASE_IMAGE} AS runtime
ARG MILI_UID=10001
# 1 = install g++ so torch can JIT-build the AVX-512 bf16 decode kernel (CPU serving, ~200 MB);
# 0 for CUDA images, where the kernel is never used.
ARG CPU_KERNEL_TOOLCHAIN=1

# Same Python as the builder, so the copied virtualenv's interpreter links resolve.
# ${packages} is split into words on purpose (a list of package names).
# hadolint ignore=DL3008,SC2086
RUN packages=""; \
    command -v python3 >/dev/null 2>&1 || packages="python3"; \
    [ "${CPU_KERNEL_TOOLCHAIN}" = "1" ] && packages="${packages} g++"; \
    if [ -n "${packages}" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends ${packages} \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --system --gid "${MILI_UID}" mili \
    && useradd --system --uid "${MILI_UID}" --gid mili --home-dir /home/mili --create-home \
        --shell /usr/sbin/nologin mili \
    && mkdir -p /models /var/cache/mili \
    && chown "${MILI_UID}:${MILI_UID}" /var/cache/mili

COPY --from=builder /opt/venv /opt/venv
COPY --chmod=0755 deploy/docker/entrypoint.sh /usr/local/bin/mili-entrypoint
COPY --chmod=0644 deploy/docker/healthcheck.py deploy/docker/fetch_model.py /opt/mili/

# Every cache torch, transformers and the hub client write goes under one directory, so a read-only
# root filesystem needs a single writable volume (mounted at /var/cache/mili in Kubernetes).
ENV PATH="/opt/venv/bin:${PATH}" \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    MILI_HOST=0.0.0.0 \
    MILI_PORT=8000 \
    MILI_MODEL="" \
    MILI_CACHE_DIR=/var/cache/mili \
    HF_HOME=/var/cache/mili/huggingface \
    XDG_CACHE_HOME=/var/cache/mili \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/mili/torchinductor \
    TRITON_CACHE_DIR=/var/cache/mili/triton \
    TORCH_EXTENSIONS_DIR=/var/cache/mili/torch_extensions

# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER ${MILI_UID}:${MILI_UID}
WORKDIR /home/mili

EXPOSE 8000
# uvicorn drains on SIGTERM: /health turns 503, in-flight requests get --shutdown-grace-period seconds.
STOPSIGNAL SIGTERM
# start-period covers loading (or building the embedded model); 503 during it does not count.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "/opt/mili/healthcheck.py"]

ENTRYPOINT ["/usr/local/bin/mili-entrypoint"]
CMD []
