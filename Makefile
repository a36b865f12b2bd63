# One virtual environment under .venv, built from this repository's own files.
# torch==2.13.0 goes in first: it is the CPU build (a bare "torch" pulls a multi-GB CUDA build).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
NPM    ?= npm
WEB    := app/web

.PHONY: install web run train test test-fast lint bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[server,train,dev]'
	touch $@

# The web app's front-end packages (uPlot, js-yaml), exactly as app/web/package-lock.json pins them.
$(WEB)/node_modules/.installed: $(WEB)/package.json $(WEB)/package-lock.json
	@if command -v $(NPM) >/dev/null 2>&1; then \
		$(NPM) ci --prefix $(WEB) --no-audit --no-fund --loglevel=error && touch $@; \
	else \
		echo "npm not found: the web app's charts need Node.js and npm (then run make web)"; \
	fi

web: $(WEB)/node_modules/.installed

install: $(VENV)/.installed web

## run: the service on the embedded default (SQLite and a local broker under ./var) unless
## MUONFORGE_DATABASE_URL / MUONFORGE_REDIS_URL are set; prints the URL and an API key
run: install
	$(VENV)/bin/muonforge up

## train: one example job spec locally, no service
train: install
	$(VENV)/bin/muonforge train examples/synthetic-muon.yaml --out runs/synthetic-muon

## bench: the optimizer step benchmark (figures in docs/benchmarks.md)
bench: install
	$(PY) bench/optim_step.py

## test: the whole test suite (unit, property and convergence tests), in TEST_WORKERS processes
## (a test file stays in one; each process has its own database, Redis and services)
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

## test-fast: the unit and in-process tests alone, no process of the service, no browser, no long
## training (markers system, browser, slow): a couple of minutes, no Postgres-free promise
test-fast: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not system and not browser and not slow"

lint: install
	$(VENV)/bin/ruff check contract optim app worker muonforge migrations tests bench
	$(VENV)/bin/ruff format --check contract optim app worker muonforge migrations tests bench
	$(VENV)/bin/mypy
