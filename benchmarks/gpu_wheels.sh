#!/usr/bin/env bash
# The Python packages the GPU run needs and the bare GPU machine lacks (it has
# torch with CUDA, triton, transformers, einops, ninja and nvcc, and no
# package index), fetched here into DIR for the device run to carry:
#
#   DIR/part1   flashinfer-python (its kernels compile on first use with the
#               machine's nvcc), alone: its wheel is ~61 MB of the 64 MiB a
#               device call may carry
#   DIR/part2   what flashinfer imports (apache-tvm-ffi, cuda-python,
#               cuda-tile, nvidia-cudnn-frontend, nccl4py, nccl-extensions);
#               mamba-ssm built here without its CUDA extension
#               (MAMBA_SKIP_CUDA_BUILD: its Triton kernels are what the
#               "flashinfer" backend uses, layers/backends/flashinfer/mamba_ssm.py); and
#               causal-conv1d's source, which the GPU machine can build
#   DIR/site.tar.xz  every wheel of both parts unpacked, as one xz-packed tree
#   DIR/oracle  transformers 5.24 and what it imports (numpy aside), for the
#               suite's "families" part: 29 MB, carried on its own
#
#   bash benchmarks/gpu_wheels.sh [DIR]        # default DIR: gpu_wheels (git ignores it)
#
# On the GPU machine, one device call carrying gpu_wheels/site.tar.xz:
#   bash benchmarks/gpu_suite.sh OUT     (its install part unpacks it into .gpu_site)
# (or one call per part folder, the machine kept warm between them; causal-conv1d's
# source, optionally: pip install --no-build-isolation gpu_wheels/part2/causal_conv1d-*.tar.gz)
# The wheels are for the GPU machine's Python (3.12 by default; GPU_PYTHON to change).
set -euo pipefail
DIR=${1:-gpu_wheels}
PY=${GPU_PYTHON:-3.12}
PYTHON=${PYTHON:-python3}
mkdir -p "$DIR/part1" "$DIR/part2"
fetch() {  # fetch PART SPEC...: binary wheels for the GPU machine, no dependencies
    local part=$1
    shift
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any --dest "$DIR/$part" "$@"
}
fetch part1 "flashinfer-python==0.7.2.post1"
fetch part2 "apache-tvm-ffi>=0.1.11,<0.2" "cuda-python>=12.0" "cuda-tile>=1.4.0" "nvidia-cudnn-frontend>=1.31.0" \
    "nccl4py>=0.4.1" "nccl-extensions>=0.1.0"
# mamba-ssm has no wheel: build its Python part here (its setup.py would look
# for a prebuilt CUDA wheel without MAMBA_FORCE_BUILD).
MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation \
    --wheel-dir "$DIR/part2" "mamba-ssm==2.3.2.post1"
# causal-conv1d: the source (reading its metadata runs its setup.py, which must not build here).
CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE "$PYTHON" -m pip download --quiet --no-deps \
    --no-binary=:all: --no-build-isolation --dest "$DIR/part2" "causal-conv1d==1.7.0"
# transformers as the tests build their models with (the suite's "families" part).
"$PYTHON" -m pip download --quiet --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any --dest "$DIR/oracle" "transformers==5.24.0"
rm -f "$DIR"/oracle/numpy-*.whl  # the machine's numpy stays (torch's)
# The wheels unpacked into one tree and xz-packed: 600 MB that pack to 34 MB
# (zip's deflate left 100 MB), so one device call carries them beside the
# repository and the suite unpacks them in seconds (a few minutes here).
tmp=$(mktemp -d)
for wheel in "$DIR"/part1/*.whl "$DIR"/part2/*.whl; do
    "$PYTHON" -m zipfile -e "$wheel" "$tmp"
done
tar -C "$tmp" -cf - . | xz -9e -T0 >"$DIR/site.tar.xz"
rm -rf "$tmp"
du -sh "$DIR/part1" "$DIR/part2" "$DIR/site.tar.xz"
