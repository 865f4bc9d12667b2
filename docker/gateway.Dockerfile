# syntax=docker/dockerfile:1
# The gateway: FastAPI, tokenizers and gRPC, no torch. Its model files (config.json, the
# tokenizer and chat template; no weights) come from the worker image, so gateway and
# workers serve the very same model. Build the worker first, from the repository root:
#   docker build -f docker/worker.Dockerfile -t switchboard-worker:dev .
#   docker build -f docker/gateway.Dockerfile --build-arg WORKER_IMAGE=switchboard-worker:dev \
#     -t switchboard-gateway:dev .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG WORKER_IMAGE=switchboard-worker:dev

FROM ${WORKER_IMAGE} AS model
USER root
RUN find /opt/switchboard/models -name '*.safetensors' -delete

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
COPY . /src
# pyproject.toml declares torch for the whole package (the worker needs it): install the
# gateway's own lock (locks/gateway.txt: its distributions at locks/runtime.txt's versions,
# hash-checked), then the package without dependencies. Then prove the gateway and
# `switchboard admin` import, and that torch is absent.
RUN pip install --require-hashes --no-deps -r /src/locks/gateway.txt -r /src/locks/build.txt \
 && pip install --no-deps --no-build-isolation /src \
 && python -c "import gateway.main, switchboard.admin_client" \
 && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 switchboard \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin switchboard
COPY --from=build /opt/venv /opt/venv
COPY --from=model /opt/switchboard /opt/switchboard
ENV PATH=/opt/venv/bin:$PATH SWITCHBOARD_HOME=/opt/switchboard HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["switchboard"]
CMD ["gateway", "--host=0.0.0.0"]
