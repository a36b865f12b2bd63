# One virtual environment under .venv, built from this repository's own files.
# torch==2.13.0 goes in first: it is the CPU build (a bare "torch" pulls a multi-GB CUDA build).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

.PHONY: install run train test lint bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

install: $(VENV)/.installed

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

## test: the whole test suite (unit, property and convergence tests)
test: install
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check optim app worker muonforge migrations tests bench
	$(VENV)/bin/ruff format --check optim app worker muonforge migrations tests bench
