# One-command set-up: every target creates the virtualenv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: sim test test-slow lint typecheck bench up clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile -e '.[dev]'  # bytecode on first import: faster set-up
	touch $(STAMP)

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

up: $(STAMP)
	$(BIN)/tokenfleet up

clean:
	rm -rf $(VENV) out .tokenfleet .pytest_cache .mypy_cache .ruff_cache
