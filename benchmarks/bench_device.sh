#!/usr/bin/env bash
# The GPU check, at most ~6 minutes on one H100/H200 (torch, JAX-CUDA, numpy, pytest; Triton for the fused
# gather; no vLLM needed):
#   1. the torch backend's CUDA tests (the fused gather's own test as a separate step: it compiles a kernel);
#   2. bench_gpu_transfer.py: the torch backend vs a pinned memcpy at 16, 64, 256 and 2,048 KiB pages, one way
#      and both ways at once (vs a two-stream memcpy), with 128 and with 1,024 staging blocks; and the fused
#      gather (one Triton launch per piece for all KV tensors) beside the index gather at 8 and 64 layers;
#   3. bench_jax_transfer.py at the Qwen3-32B per-device shape (64 layers, 1 KV head x 128, bf16): 128 MiB
#      steps at 128- and 256-token blocks, and passes of 16 and 1,000 scattered blocks, vs a raw device_put
#      (and the per-block loop kernel at 16 blocks, for comparison).
#   4. bench_tier_cuda.py: the tiering path (device -> pinned slab -> signed chunk files -> a second engine's slab
#      -> its device) at 8 and 64 layers, bit-exact, beside plain file writes/reads and a pinned memcpy.
# Every result is JSON (with the device name) under $BENCH_RESULTS_DIR (default benchmarks/results).
# Runs every step even if one fails; exits non-zero if any did.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
rc=0
# BENCH_ONLY=WORD runs only the steps whose command line contains WORD (e.g. BENCH_ONLY=fused: the fused gather's).
step() {
    [[ -n "${BENCH_ONLY:-}" && "$*" != *"$BENCH_ONLY"* ]] && return 0
    echo "== $*"; local t0=$SECONDS; "$@" || { echo "!! failed ($?): $*"; rc=1; }; echo "== $((SECONDS - t0)) s"
}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
QWEN=(--layers 64 --kv-heads 1 --head-dim 128 --dtype bfloat16 --skip-device-put-path)
step timeout 90 $PY -m pytest -q --noconftest -p no:cacheprovider tests/gpu/test_gpu_cuda.py tests/gpu/test_gpu_cuda_logic.py \
    -k "not fused"
step timeout 120 $PY benchmarks/bench_gpu_transfer.py --device cuda --page-kib 16 64 256 2048 --out gpu_transfer_cuda
# The fused gather: bytes identical to the index gather both ways, then side by side (same tensors, same memcpy).
step timeout 90 $PY -m pytest -q --noconftest -p no:cacheprovider tests/gpu/test_gpu_cuda.py -k fused
step timeout 120 $PY benchmarks/bench_gpu_transfer.py --device cuda --page-kib 16 256 2048 --gather index fused \
    --out gpu_transfer_cuda_fused
step timeout 120 $PY benchmarks/bench_gpu_transfer.py --device cuda --layers 64 --total-mib 1024 --page-kib 16 256 \
    --gather index fused --out gpu_transfer_cuda_fused_64layers
step timeout 150 $PY benchmarks/bench_jax_transfer.py "${QWEN[@]}" --block-tokens 128 --pass-blocks 16 1000 \
    --out jax_transfer_cuda_passes
step timeout 120 $PY benchmarks/bench_gpu_transfer.py --device cuda --page-kib 16 64 256 2048 --staging-blocks 1024 \
    --out gpu_transfer_cuda_staging1024
step timeout 150 $PY benchmarks/bench_jax_transfer.py "${QWEN[@]}" --step-mib 128 --block-tokens 128 256 --out jax_transfer_cuda
# The per-block loop kernel (the CPU default) on the same device, for comparison.
step timeout 120 $PY benchmarks/bench_jax_transfer.py "${QWEN[@]}" --block-tokens 128 --pass-blocks 16 --kernel loop \
    --out jax_transfer_cuda_loop
step timeout 150 $PY benchmarks/bench_tier_cuda.py --device cuda --out tier_cuda
exit $rc
