#!/usr/bin/env bash
# The CUDA backend's check on a GPU machine (issue 33), in one call that ends by its own
# deadline: the carried wheels installed offline into a target folder, then
#   1. pytest -m gpu        the kernels against the NumPy references, golden parity in
#                           float32, tolerances in float16/bfloat16, every family the
#                           CUDA backend runs (tests/engine/test_gpu_*.py)
#   2. benchmarks/gpu_gemv.py  the matrix-vector kernel alone on the 8B shape's matrices,
#                           each format, 1 and 8 rows, against a device copy's bandwidth
#   3. benchmarks/gpu.py    decode tok/s, device ms per token with and without CUDA
#                           graphs, bandwidth against a measured device copy, 1 and 8
#                           streams: SmolLM2 and the Llama-3.2-1B shape; then the
#                           Llama-3.1-8B shape in Q8_0, one stream (the 60 % goal)
#   4. benchmarks/gpu_split.py  two processes, a CUDA stage and a CPU stage, against the
#                           golden greedy tokens
# Before them, `model` gathers the test model's halves the calls carried (scripts/gpu-model.sh:
# SmolLM2 does not fit in one call's 64 MiB beside the source and the wheels), so a lease
# runs two calls back to back:
#   GPU_CHECK_STEPS="install model" scripts/gpu-check.sh OUT 60     (carry .whl .gpu-model/a)
#   GPU_CHECK_STEPS="model pytest gemv bench bench-8b split" scripts/gpu-check.sh OUT
#                                                                   (carry .gpu-model/b)
# GPU_CHECK_STEPS names the steps to run (default: all); the others are left out silently.
# Each step's output goes to OUT/<step>.log, one line per step to OUT/summary.txt; a step
# gets the time left before the deadline (default 480 s from the start) and the check stops
# there. Exit status: the number of steps that failed or did not run.
#
#   scripts/gpu-check.sh OUT [SECONDS]          on the GPU machine, from the repo root
#   GPU_CHECK_DRY=1 scripts/gpu-check.sh OUT    print and log each step's command instead
#                                               (tests/test_scripts_gpu.py runs this)
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${1:?usage: scripts/gpu-check.sh OUT [SECONDS]}"
budget="${2:-480}"
dry="${GPU_CHECK_DRY:-}"
steps="${GPU_CHECK_STEPS:-install model pytest gemv bench bench-8b split}"
python="${PYTHON:-python3}"
site="${GPU_CHECK_SITE:-/tmp/meshnode-site}"
mkdir -p "$out"
: >"$out/summary.txt"
started=$SECONDS
failed=0

left() { echo $((budget - (SECONDS - started))); }

# step NAME SHARE CMD...: run CMD with at most SHARE seconds (and never past the deadline),
# its output in OUT/NAME.log, a line in OUT/summary.txt.
step() {
    local name="$1" share="$2"
    shift 2
    [[ " $steps " == *" $name "* ]] || return 0
    local limit
    limit="$(left)"
    ((share < limit)) && limit="$share"
    if ((limit < 5)); then
        echo "$name: skipped, deadline reached" | tee -a "$out/summary.txt"
        failed=$((failed + 1))
        return
    fi
    if [[ -n "$dry" ]]; then
        echo "$*" >"$out/$name.log"
        echo "$name: dry (limit ${limit}s): $*" | tee -a "$out/summary.txt"
        return
    fi
    local began=$SECONDS rc=0
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
    local verdict="ok"
    ((rc == 124 || rc == 137)) && verdict="timed out after ${limit}s"
    ((rc != 0 && rc != 124 && rc != 137)) && verdict="failed (exit $rc)"
    ((rc != 0)) && failed=$((failed + 1))
    echo "$name: $verdict in $((SECONDS - began))s" | tee -a "$out/summary.txt"
}

step install 60 "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$site" .whl/*.whl
step model 60 bash scripts/gpu-model.sh unpack "$site"
export PYTHONPATH="$site:$root:$root/protocol:$root/packaging"
export PYTHONUNBUFFERED=1
[[ -z "$dry" ]] && nvidia-smi >"$out/nvidia-smi.log" 2>&1
step pytest 150 "$python" -m pytest -m gpu -q -p no:cacheprovider -o addopts= tests/engine
step gemv 60 "$python" benchmarks/gpu_gemv.py
step bench 120 "$python" benchmarks/gpu.py --models default,1b --formats f16,q8_0 --tokens 64
step bench-8b 90 "$python" benchmarks/gpu.py --models 8b --formats q8_0 --streams 1 --tokens 32
step split 130 "$python" benchmarks/gpu_split.py
echo "failed or not run: $failed; $(($SECONDS - started))s of ${budget}s" | tee -a "$out/summary.txt"
exit "$failed"
