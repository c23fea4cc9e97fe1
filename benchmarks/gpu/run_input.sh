#!/usr/bin/env bash
# Issue 35 on a GPU machine, in one device call of under 5 minutes: the input's scaling on its 16 CPUs (the
# training input alone, no GPU needed for it: `benchmarks/input.py`, `$READERS` at `$WORKERS` workers, each
# case under a deadline), then `fit` of ViT-B/16 bf16 from the JPEG folder against the device-resident
# step (`benchmarks/gpu_input_fit.py`, its last `FIT` s); results written as they come, so a call cut
# short keeps what ran.
#
#   bash benchmarks/gpu/run_input.sh --download   # here, with a network: the wheels into .whl/ (8.2 MB)
#   bash benchmarks/gpu/run_input.sh --rehearse   # here, on the CPU: test size, TensorFlow blocked
#   bash benchmarks/gpu/run_input.sh              # on the GPU machine (run's carry: [".whl"])
#
# Results: $OUT (the device's returned folder) or benchmarks/results/input-gpu-<date>/: input.jsonl
# (one JSON line per case), input.json (with ratios and lscpu), input_fit.jsonl, stages.txt, lscpu.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
T0=$(date +%s)
PYTHON=${PYTHON:-python3}
TOTAL=${TOTAL:-270} FIT=${FIT:-80}
FILES=2000 BATCHES=${BATCHES:-60} FIT_ARGS=()
read -ra WORKERS <<<"${WORKERS:-1 2 8 16}"
read -ra READERS <<<"${READERS:-keras_vit-pyinput keras_vit-pyinput-threads keras_vit-pyinput-grain timm}"
WHEELS=(keras==3.15.1 namex optree grain==0.2.18 array_record cloudpickle etils fsspec portpicker protobuf
    psutil absl-py typing_extensions zipp)
case "${1:-}" in
--download)
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}" && du -sh .whl
    exit $?
    ;;
--rehearse)
    PYTHON=${PYTHON_REHEARSE:-python}
    FILES=120 BATCHES=2 WORKERS=(1 2) TOTAL=900 FIT_ARGS=(--tiny --steps 20 --warmup 5)
    export PYTHONPATH=$ROOT/benchmarks/gpu/no_tensorflow:$ROOT
    ;;
*)
    if ! "$PYTHON" -c "import keras, grain" 2>/dev/null; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 2
    fi
    export PYTHONPATH=/tmp/site:$ROOT
    ;;
esac
RESULTS=${OUT:-$ROOT/benchmarks/results/input-gpu-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$RESULTS"
export TF_CPP_MIN_LOG_LEVEL=3 KERAS_BACKEND=jax PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
lscpu >"$RESULTS/lscpu.txt"
"$PYTHON" -c "import sys, keras, numpy, PIL, torch, timm; print(sys.version, keras.__version__, numpy.__version__, \
PIL.__version__, torch.__version__, timm.__version__)" | tee "$RESULTS/stages.txt"
# The folder first (outside the cases' deadline: 2,000 files take about a minute there), then every case
# in a fresh process under what is left of TOTAL less FIT.
FOLDER=/tmp/keras_vit_input_bench_$FILES
"$PYTHON" -c "import sys; sys.path.insert(0, 'benchmarks'); from input import make_folder; make_folder('$FOLDER', $FILES)"
echo "== folder: $FILES files at +$(($(date +%s) - T0)) s" | tee -a "$RESULTS/stages.txt"
LEFT=$((TOTAL - FIT - ($(date +%s) - T0)))
timeout -k 5 "$LEFT" "$PYTHON" benchmarks/input.py --folder "$FOLDER" --files "$FILES" \
    --workers "${WORKERS[@]}" --batches "$BATCHES" --readers "${READERS[@]}" --deadline "$LEFT" \
    --out "$RESULTS/input.json" | tee "$RESULTS/input.jsonl"
echo "== input.py: exit ${PIPESTATUS[0]} at +$(($(date +%s) - T0)) s" | tee -a "$RESULTS/stages.txt"
LEFT=$((TOTAL - ($(date +%s) - T0)))
JAX_PLATFORMS= timeout -k 5 "$LEFT" "$PYTHON" benchmarks/gpu_input_fit.py --output "$RESULTS" \
    --folder "$FOLDER" --files "$FILES" "${FIT_ARGS[@]}"
echo "== gpu_input_fit.py: exit $? at +$(($(date +%s) - T0)) s" | tee -a "$RESULTS/stages.txt"
