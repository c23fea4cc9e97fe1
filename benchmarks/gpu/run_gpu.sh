#!/usr/bin/env bash
# The GPU benchmark in one go (benchmarks/gpu.py; method in its docstring and benchmarks/README.md).
#
#   bash benchmarks/gpu/run_gpu.sh prepare          # here, with network: Keras/keras_hub wheels to .whl/
#   bash benchmarks/gpu/run_gpu.sh --part b16_train # on the GPU machine (device run, carry [".whl"]),
#   ... --part s16_train | l16_train | b16_384 | inference | attention: one device call each (< 8 min;
#   cases.GPU_PARTS; any gpu.py options)
#   bash benchmarks/gpu/run_gpu.sh --rehearse       # on a CPU: test-size models, TensorFlow blocked
#
# On the GPU machine (Python 3.12 with JAX, PyTorch and timm; no TensorFlow, no Keras) the wheels
# are installed into .site/ and put on PYTHONPATH. Results go to $OUT (the device's folder that
# comes back) or benchmarks/results/gpu-<date>/: gpu_results.jsonl as cases finish,
# gpu_results.json and gpu_results.md at the end, nvidia-smi.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
WHEELS="keras==3.15.1 namex optree keras-hub kagglehub kagglesdk"

if [[ "${1:-}" == "prepare" ]]; then
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl $WHEELS
    exit 0
fi

PYTHON=${PYTHON:-python3}
ARGS=()
if [[ "${1:-}" == "--rehearse" ]]; then
    shift
    PYTHON=${PYTHON_REHEARSE:-python}
    SITE=$(mktemp -d)
    # Pure-Python wheels only: optree's (and grain's) are for the GPU machine's Python 3.12.
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
        $(ls .whl/*-py3-none-any.whl)
    export PYTHONPATH=$ROOT/benchmarks/gpu/no_tensorflow:$SITE:$ROOT
    ARGS=(--tiny --budget "${BUDGET:-300}")
else
    if ! "$PYTHON" -c "import keras" 2>/dev/null; then
        if ! ls .whl/keras-*.whl >/dev/null 2>&1; then
            echo "No Keras here and no wheels in .whl/: run 'bash benchmarks/gpu/run_gpu.sh prepare' on a" \
                "machine with PyPI and carry .whl along." >&2
            exit 2
        fi
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site .whl/*.whl
    fi
    export PYTHONPATH=$ROOT/.site:$ROOT
fi
RESULTS=${OUT:-$ROOT/benchmarks/results/gpu-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$RESULTS"
export TF_CPP_MIN_LOG_LEVEL=3 KERAS_BACKEND=jax  # each worker sets its own backend
(nvidia-smi || echo "no nvidia-smi") >"$RESULTS/nvidia-smi.txt" 2>&1
"$PYTHON" -c "import sys, jax, torch, timm, keras, keras_hub; print(sys.version); \
print('jax', jax.__version__, jax.devices()); print('torch', torch.__version__, torch.cuda.is_available()); \
print('timm', timm.__version__, 'keras', keras.__version__, 'keras_hub', keras_hub.__version__); \
print('tensorflow imported:', 'tensorflow' in sys.modules)"
"$PYTHON" benchmarks/gpu.py --python "$PYTHON" --output "$RESULTS" "${ARGS[@]}" "$@"
"$PYTHON" benchmarks/gpu.py --report "$RESULTS/gpu_results.json" >"$RESULTS/gpu_results.md"
