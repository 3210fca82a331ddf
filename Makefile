# One-command set-up: every target creates the virtualenv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: sim test test-slow typecheck bench up clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

## Main job: simulate the peer routers and TokenPilot on a bundled synthetic workload.
sim: $(STAMP)
	$(BIN)/tokenfleet sim --synthetic mixed --instances 8 --load 0.8 \
		--policy round_robin --policy llmd_weighted --policy tokenpilot \
		--json out/sim.json --plot out/plots

## Tests: type-check the policy core, then the default pytest suite (no GPU, no ../shared needed).
test: $(STAMP) typecheck
	$(BIN)/pytest -q

typecheck: $(STAMP)
	$(BIN)/mypy

## Longer suites (marked slow), run separately.
test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

up: $(STAMP)
	$(BIN)/tokenfleet up

clean:
	rm -rf $(VENV) out .tokenfleet .pytest_cache .mypy_cache
