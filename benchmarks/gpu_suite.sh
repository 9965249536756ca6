#!/usr/bin/env bash
# The GPU measurements and checks, on a bare machine with torch (CUDA),
# triton and transformers and no package index (run from the repository
# root: hybridkv is imported from the tree). Writes logs, tables and JSON
# into OUTDIR:
#
#   bash benchmarks/gpu_suite.sh OUTDIR             # a GPU: the default parts fit one 9-minute device call
#   bash benchmarks/gpu_suite.sh OUTDIR --dry-run   # anywhere: every part built small, on the CPU (in the tests),
#                                                   # kernel_tests and oracle included
#
# It runs $PYTHON (default: python3). The default parts, in this order, each
# under its own time limit (they add up to 510 s; FlashInfer's JIT, two
# modules of ~70 s each on a fresh machine, comes last so that it cannot
# starve the engine rows):
#
#   env.txt             the device, driver, library versions
#   install.txt         the wheels benchmarks/gpu_wheels.sh fetched, unpacked into $GPU_SITE (default
#                       .gpu_site): gpu_wheels/site.tar.xz (all of them unpacked and xz-packed, 34 MB:
#                       one device call carries it beside the tree) or gpu_wheels/part*/*.whl
#   engine_gemma3.txt/.json, engine_jamba.txt/.json
#                       benchmarks/engine_throughput.py: the engine on Gemma-3-1B- and
#                       ~1B-Jamba-shaped random models in bf16, batch 64 and 1, CUDA graphs on,
#                       backend triton ($GPU_ENGINE_BACKENDS: triton,triton+flashinfer adds
#                       FlashInfer's, whose JIT needs minutes more), beside the weights-read bound
#   profile.txt/.json   benchmarks/gpu_profile.py: decode steps at batch 1 and 64 (graphs on) and
#                       2,048-token prefill steps under torch.profiler: step, kernel and launch
#                       counts, top kernels
#   prefill.txt/.json   benchmarks/kernels.py --only prefill: the paged prefill kernel at
#                       Gemma-3-27B's heads, its tile sweep with float32 tiles and with 16-bit dots
#                       (dot_16bit), beside FlashInfer's prefill on the same pool
#
# More parts, named in GPU_SUITE_PARTS (the default is "install engine_gemma3
# engine_jamba profile prefill"):
#   kernel_tests        tests/test_triton_kernels.py compiled on the GPU, real sizes included
#   kernels             benchmarks/kernels.py whole: decode at 64 x 8K and 32K, prefill, store, Mamba
#   oracle              the engine against transformers on CUDA in bf16 (loose bounds), graphs included
#   families            tests/test_recurrent_families.py on CUDA in float32 with the CPU's bounds (Mamba-2,
#                       short-conv and Gated DeltaNet hybrids; transformers on the CPU), with the transformers
#                       release the tests build their models with (gpu_wheels/oracle: the machine's
#                       5.17 predates some of these families' modeling files)
#   engine_full         both engine models with transformers' generate beside them and graphs off too
#
# A part that fails or runs out of time is logged and the suite goes on (an
# engine part prints each row as it completes, so its log keeps what finished);
# the exit status is the number of parts that failed.
set -u
OUT=${1:?usage: gpu_suite.sh OUTDIR [--dry-run]}
DRY=${2:-}
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
GPU_SITE=${GPU_SITE:-$PWD/.gpu_site}
export PYTHONPATH="$GPU_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    HYBRIDKV_CACHE="${HYBRIDKV_CACHE:-$OUT/.cache}"
failed=0

DEFAULT_PARTS="install engine_gemma3 engine_jamba profile prefill"
[ "$DRY" = "--dry-run" ] && DEFAULT_PARTS="$DEFAULT_PARTS kernel_tests oracle"  # all of it, small
PARTS=" ${GPU_SUITE_PARTS:-$DEFAULT_PARTS} "
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

install_wheels() {  # the carried wheels (or their packed tree), each installed once; says what it did
    local found=0
    if [ -f gpu_wheels/site.tar.xz ]; then  # every wheel unpacked and xz-packed: 34 MB, one call carries it
        found=1
        echo "unpacking gpu_wheels/site.tar.xz into $GPU_SITE"
        mkdir -p "$GPU_SITE" && tar -C "$GPU_SITE" -xJf gpu_wheels/site.tar.xz || return 1
    fi
    for dir in gpu_wheels/part*; do
        compgen -G "$dir/*.whl" >/dev/null || continue
        found=1
        echo "installing $dir: $(cd "$dir" && ls -- *.whl | tr '\n' ' ')"
        "$PYTHON" -m pip install --quiet --no-index --no-deps --upgrade --target "$GPU_SITE" "$dir"/*.whl || return 1
    done
    [ $found -eq 1 ] || echo "no wheels carried (gpu_wheels/part*/ is empty): using what $GPU_SITE holds"
    "$PYTHON" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
    return 0
}

{
    date -u
    nvidia-smi 2>&1 || echo "no nvidia-smi"
    "$PYTHON" -c "import sys, torch, triton, transformers; print(sys.version); print('torch', torch.__version__, \
'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name()); \
print('triton', triton.__version__, 'transformers', transformers.__version__)"
    git log -1 --format="commit %H %cd" 2>/dev/null || echo "commit: not a git checkout"
} >"$OUT/env.txt" 2>&1

export -f install_wheels
export PYTHON GPU_SITE
part install 30 bash -c install_wheels

if [ "$DRY" = "--dry-run" ]; then
    # The same parts on the CPU: shrunk models, kernels under triton's interpreter.
    export TRITON_INTERPRET=1
    part prefill 300 "$PYTHON" -m benchmarks.kernels --quick --only prefill --out "$OUT/prefill.json"
    for model in gemma3 jamba; do
        part engine_$model 400 "$PYTHON" -m benchmarks.engine_throughput --dry-run --models $model-1b-shape \
            --backends auto,torch --no-transformers --only throughput --repeat 1 --out "$OUT/engine_$model.json"
    done
    part profile 300 "$PYTHON" -m benchmarks.gpu_profile --dry-run --steps 3 --batches 1 --out "$OUT/profile.json"
    part kernel_tests 600 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
        -k "store or fixed_shape or backend_is_chosen or self_test"
    part oracle 600 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_engine_oracle.py \
        -k "batch_of_different_lengths and fixed-decode"
else
    # One untimed run per case first (Triton compiles into its disk cache), then one timed; 32 new
    # tokens per prompt; transformers is left out to fit the call (engine_full has it).
    ENGINE=("$PYTHON" -m benchmarks.engine_throughput --device cuda --dtype bfloat16 --graphs on
            --backends "${GPU_ENGINE_BACKENDS:-triton}" --no-transformers --only throughput --repeat 1
            --warm-runs 1 --num-prompts 64 --new-tokens 32)
    part engine_gemma3 115 "${ENGINE[@]}" --models gemma3-1b-shape --out "$OUT/engine_gemma3.json"
    part engine_jamba 115 "${ENGINE[@]}" --models jamba-1b-shape --out "$OUT/engine_jamba.json"
    part profile 45 "$PYTHON" -m benchmarks.gpu_profile --batches 1,64 --modes graphs,prefill --steps 5 \
        --out "$OUT/profile.json"
    part prefill 205 "$PYTHON" -m benchmarks.kernels --only prefill --out "$OUT/prefill.json"
    # Tests in parallel where pytest-xdist is there (their Triton compiles are CPU work); the
    # real-size tests one at a time: each takes up to ~50 GB of the GPU.
    XDIST=$("$PYTHON" -c "import xdist" 2>/dev/null && echo "-n 8")
    part kernel_tests 300 bash -c "'$PYTHON' -m pytest -q -p no:cacheprovider $XDIST -k 'not real_size' \
        tests/test_triton_kernels.py; a=\$?; '$PYTHON' -m pytest -q -p no:cacheprovider -k real_size \
        tests/test_triton_kernels.py && exit \$a"
    part kernels 360 "$PYTHON" -m benchmarks.kernels --out "$OUT/kernels.json"
    part oracle 240 "$PYTHON" -m pytest -q -p no:cacheprovider $XDIST tests/test_engine_oracle.py --device cuda \
        --dtype bfloat16 -k "batch_of_different_lengths or preemption or chunked_prefill or triton or flashinfer"
    part families 420 bash -c "'$PYTHON' -m pip install --quiet --no-index --no-deps --upgrade \
        --target '$GPU_SITE/oracle' gpu_wheels/oracle/*.whl || exit 1; export PYTHONPATH='$GPU_SITE/oracle':\$PYTHONPATH; \
        '$PYTHON' -c 'import transformers; print(\"transformers\", transformers.__version__)'; \
        '$PYTHON' -m pytest -q -p no:cacheprovider -rA --durations=10 tests/test_recurrent_families.py --device cuda"
    part engine_full 560 "$PYTHON" -m benchmarks.engine_throughput --device cuda --dtype bfloat16 \
        --graphs both --backends "${ENGINE_BACKENDS:-auto}" --only throughput --repeat 1 --num-prompts 64 \
        --new-tokens 64 --out "$OUT/engine_full.json"
fi
echo "gpu_suite: $failed part(s) failed; logs in $OUT"
exit $failed
