# Shipyard: `make release` builds the example release, `make test` runs the checks.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: release test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

release: $(STAMP)
	$(BIN)/shipyard compile --check
	$(BIN)/dvc repro
	$(BIN)/shipyard verify build/tiny-gpt2/bundle

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_hashing.py
	$(BIN)/python benchmarks/bench_noop_repro.py

clean:
	rm -rf build .dvc/cache .dvc/tmp
