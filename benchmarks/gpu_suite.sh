#!/usr/bin/env bash
# The GPU measurements and checks in one run, on a bare machine with torch
# (CUDA), triton and transformers (nothing installed: run from the
# repository root, hybridkv is imported from the tree). Writes its logs,
# tables and JSON into OUTDIR:
#
#   bash benchmarks/gpu_suite.sh OUTDIR             # an H100/H200: about 20 minutes (GPU_SUITE_PARTS: below)
#   bash benchmarks/gpu_suite.sh OUTDIR --dry-run   # anywhere: every case built small, on the CPU
#
# It runs $PYTHON (default: python3), so a caller picks the interpreter that
# has torch: PYTHON=/path/to/venv/bin/python bash benchmarks/gpu_suite.sh OUT
#
#   env.txt             the device, driver, library versions
#   kernel_tests.txt    tests/test_triton_kernels.py compiled on the GPU, real sizes included
#   kernels.txt/.json   benchmarks/kernels.py: paged decode attention at 64 x 8K and 32K (bf16)
#                       against contiguous SDPA and the gather-then-SDPA reference; prefill,
#                       store and Mamba steps; bandwidth against the measured copy rate
#   engine_gemma3.txt/.json, engine_jamba.txt/.json
#                       benchmarks/engine_throughput.py: the engine on Gemma-3-1B- and
#                       ~1B-Jamba-shaped random models in bf16 against transformers' generate,
#                       batch 1 and 64, CUDA graphs on and off, beside the weights-read bound
#   profile.txt/.json   benchmarks/gpu_profile.py: decode steps under torch.profiler, batch 1
#                       and 64, graphs on and off: step, kernel and launch counts, top kernels
#   oracle.txt          the engine against transformers on CUDA in bf16 (loose bounds),
#                       decode steps through CUDA graphs
#
# GPU_SUITE_PARTS picks parts (default: all; on a GPU "kernel_tests kernels
# engine_gemma3 engine_jamba profile oracle", under --dry-run "engine" stands for the
# two engine parts), to spread them over device calls of 10 minutes: the
# correctness parts together, then the kernels, then one engine part each.
# Where FlashInfer imports (benchmarks/gpu_wheels.sh), the oracle runs the
# engine through it too and the kernels part times it beside ours.
#
# Each part runs under its own time limit and the suite goes on past a
# failing part (its log says why); the exit status is the number of parts
# that failed.
set -u
OUT=${1:?usage: gpu_suite.sh OUTDIR [--dry-run]}
DRY=${2:-}
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HYBRIDKV_CACHE="${HYBRIDKV_CACHE:-$OUT/.cache}"
failed=0

PARTS=" ${GPU_SUITE_PARTS:-kernel_tests kernels engine engine_gemma3 engine_jamba profile oracle} "
part() {  # part NAME SECONDS COMMAND...: run, log to OUT/NAME.txt, report
    local name=$1 limit=$2
    shift 2
    [[ $PARTS == *" $name "* ]] || return 0
    local start=$SECONDS
    echo "== $name: $*" | tee "$OUT/$name.txt"
    timeout "$limit" "$@" >>"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/$name.txt"
    [ $rc -eq 0 ] || failed=$((failed + 1))
}

{
    date -u
    nvidia-smi 2>&1 || echo "no nvidia-smi"
    "$PYTHON" -c "import sys, torch, triton, transformers; print(sys.version); print('torch', torch.__version__, \
'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name()); \
print('triton', triton.__version__, 'transformers', transformers.__version__)"
} >"$OUT/env.txt" 2>&1

if [ "$DRY" = "--dry-run" ]; then
    export TRITON_INTERPRET=1
    part kernel_tests 600 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
        -k "store or fixed_shape or backend_is_chosen or self_test"
    part kernels 600 "$PYTHON" -m benchmarks.kernels --quick --out "$OUT/kernels.json"
    part engine 900 "$PYTHON" -m benchmarks.engine_throughput --dry-run --repeat 1 --graphs both --only throughput \
        --out "$OUT/engine.json"
    part profile 300 "$PYTHON" -m benchmarks.gpu_profile --dry-run --steps 3 --batches 1 --out "$OUT/profile.json"
    part oracle 600 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_engine_oracle.py \
        -k "batch_of_different_lengths and fixed-decode"
else
    # Tests in parallel where pytest-xdist is there (their Triton compiles are CPU work).
    XDIST=$("$PYTHON" -c "import xdist" 2>/dev/null && echo "-n 8")
    # The real-size tests one at a time: each takes up to ~50 GB of the GPU.
    part kernel_tests 300 bash -c "'$PYTHON' -m pytest -q -p no:cacheprovider $XDIST -k 'not real_size' \
        tests/test_triton_kernels.py; a=\$?; '$PYTHON' -m pytest -q -p no:cacheprovider -k real_size \
        tests/test_triton_kernels.py && exit \$a"
    part kernels 360 "$PYTHON" -m benchmarks.kernels --out "$OUT/kernels.json"
    # One part per model (each ~5 minutes with its warm runs: a device call apiece).
    # ENGINE_BACKENDS=auto,triton+flashinfer adds rows through FlashInfer (its JIT build takes minutes on first use).
    for model in gemma3 jamba; do
        part engine_$model 560 "$PYTHON" -m benchmarks.engine_throughput --device cuda --dtype bfloat16 \
            --models $model-1b-shape --graphs both --backends "${ENGINE_BACKENDS:-auto}" --only throughput \
            --repeat 1 --num-prompts 64 --new-tokens 64 --out "$OUT/engine_$model.json"
    done
    part profile 300 "$PYTHON" -m benchmarks.gpu_profile --out "$OUT/profile.json"
    part oracle 240 "$PYTHON" -m pytest -q -p no:cacheprovider $XDIST tests/test_engine_oracle.py --device cuda \
        --dtype bfloat16 -k "batch_of_different_lengths or preemption or chunked_prefill or triton or flashinfer"
fi
echo "gpu_suite: $failed part(s) failed; logs in $OUT"
exit $failed
