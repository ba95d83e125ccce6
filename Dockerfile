# hpservice: one image for the control plane (`hpservice serve`) and the Ray head and worker nodes.
#
#   docker build -t hpservice:0.1.0 .                                              # CPU: torch 2.13.0+cpu
#   docker build -t hpservice:0.1.0-cu128 --build-arg TORCH_VARIANT=cu128 .        # CUDA 12.8 build of torch
#   docker build -t hpservice:0.1.0-cu124 \
#     --build-arg TORCH_VARIANT=cu124 --build-arg TORCH_VERSION=2.6.0 .            # CUDA 12.4 (torch <= 2.6)
#
# Pins: the base image by tag (BASE_IMAGE; append @sha256:DIGEST for byte-identical rebuilds), torch
# by TORCH_VERSION from the PyTorch wheel index of TORCH_VARIANT (cpu, cu124, cu126, cu128, ...:
# the CUDA wheels bring their own CUDA runtime, so the same slim base serves GPUs; the node needs
# only the NVIDIA driver), every other Python package by deploy/docker/constraints.txt
# (regenerate with `python deploy/docker/lock.py`). docs/deploy.md has the details.
ARG BASE_IMAGE=python:3.11.14-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}

LABEL org.opencontainers.image.title="hpservice" \
      org.opencontainers.image.description="Distributed training service: control plane and Ray nodes" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAY_USAGE_STATS_ENABLED=0 \
    HPSERVICE_DATA_DIR=/data

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# uid/gid 1000: the manifests' runAsUser/fsGroup. /data: the API's store; /shared: the volume the API and every Ray node share (jobs/, datasets/).
RUN groupadd --gid 1000 hpservice \
 && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash hpservice \
 && install -d -o hpservice -g hpservice -m 0750 /data /shared /shared/jobs /shared/datasets

WORKDIR /opt/hpservice

# Dependencies first (a layer that survives source changes): torch alone from the PyTorch index,
# then from PyPI, all pinned by constraints.txt: torch's own dependencies (for a CUDA build, the
# nvidia-* wheels it pins exactly), the image's extras and the package's dependencies.
COPY deploy/docker/constraints.txt deploy/docker/requirements.txt pyproject.toml ./
RUN pip install --no-cache-dir --no-deps --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && pip install --no-cache-dir -c constraints.txt -r requirements.txt "torch==${TORCH_VERSION}" \
 && python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > dependencies.txt \
 && pip install --no-cache-dir -c constraints.txt -r dependencies.txt

COPY README.md ./
COPY hpservice ./hpservice
COPY actors ./actors
COPY api ./api
# Installed in place (-e), like scripts/setup: the web page (api/static) is not declared as package
# data in pyproject.toml, so a wheel install would leave it out. Bytecode is compiled now because
# the running user cannot write here.
RUN pip install --no-cache-dir --no-build-isolation --no-deps -c constraints.txt -e . \
 && pip check \
 && python -m compileall -q hpservice actors api \
 && python -c "import hpservice.actors, hpservice.api, ray, torch; print('torch', torch.__version__, 'ray', ray.__version__)" \
 && test -f api/static/index.html
COPY examples ./examples

USER 1000:1000
WORKDIR /home/hpservice

# 8000: API; Ray: 6379 GCS, 8265 dashboard, 10001 client, 8080 metrics (only on Ray nodes).
EXPOSE 8000 6379 8265 10001 8080

# For the control plane (the default command). Ray containers override it (compose, KubeRay probes).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]

# A non-loopback bind needs API tokens: pass HPSERVICE_TOKENS, or run with --tokens-file FILE.
CMD ["hpservice", "serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data"]
