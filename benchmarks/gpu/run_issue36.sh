#!/usr/bin/env bash
# Issue 36 in one device call of under 7 minutes, in priority order, each stage under a deadline;
# every stage writes JSON lines to the results folder as it goes, so a call cut short keeps what ran.
#
#   bash benchmarks/gpu/run_issue36.sh [first|second|third|fourth|fifth]  # on the GPU machine (wheels in .whl/)
#   bash benchmarks/gpu/run_issue36.sh --rehearse [first|...|fifth]       # on a CPU: test-size, no TensorFlow
#
# first (TOTAL=405 s):
#   1. nvidia-smi, versions;
#   2. benchmarks/gpu_experiments.py: the chip's bf16 matmul rate in JAX, then ViT-B/16 bf16 training
#      (batch 64: stock, split_qkv, heads_major, plain) and inference (batch 256: the same and
#      fused_padded), each timed and its kernels profiled (170 s; the variants in that order, stock
#      first, so a deadline cuts the last);
#   3. benchmarks/gpu.py: torch's matmul rates, timm eager, timm + torch.compile (foreach AdamW),
#      timm + torch.compile with fused AdamW, keras_vit on Keras's torch backend, on the same two
#      cases (160 s);
#   4. benchmarks/gpu/eager_torch_check.py: Keras's PyTorch backend's whole-model path against the
#      functional graph on CUDA, both against float64, where flash attention runs (40 s);
#   5. benchmarks/input_probe.py: JPEG decoding + augmentation on the machine's CPUs (what is left, <= 75 s).
# second (TOTAL=360 s): XLA flags on the stock ViT-B/16 training step (one process per flag set, 55 s
#   each), then ViT-S/16 bf16 training (batch 128): keras_vit JAX (variants: $S16_VARIANTS, default
#   stock), timm eager, timm + torch.compile with fused and with foreach AdamW.
# third (TOTAL=420 s): the JAX variants gpu_hlo.py found without a GPU (2026-11-29), profiled, against
#   stock: ViT-B/16 bf16 training (batch 64): `pos_matmul` (the position embedding's gradient as a matrix
#   product: no batch-minor residual stream, no transposes) and `pad_once` (also 198 tokens padded once
#   for cuDNN instead of 256 in every block); inference (batch 256): `split_qkv` (q, k, v by products of
#   their own, no strided cuts to copy) and `split_ln` (with `ln_one_pass` too); both: `ln_one_pass`
#   (LayerNorm statistics from one reduction) (160 s); then ViT-S/16 (128) and L/16 (32) training, stock
#   against `pad_once`, unprofiled (110 s); then B/16 384 px inference (64), stock against `split_qkv` and
#   `split_ln`, unprofiled (60 s); then timm + torch.compile with fused AdamW (training) and timm +
#   torch.compile (inference) on those B/16 cases, the ratios' reference in the same call (125 s). The
#   shares add up to more than TOTAL: by the 2026-11-28 H200 runs' times per variant the first stage
#   needs about 125 s of its 160, and each stage gets at most what is left.
# fourth (TOTAL=330 s): benchmarks/gpu_torch_profile.py: keras_vit's PyTorch steps, eager and with
#   `jit_compile=True`, beside timm eager's, on the same two cases: kernel tables, host time and the
#   host-device synchronisations (270 s with the compiles); then eager_torch_check.py (40 s).
# fifth (TOTAL=335 s): keras_vit on PyTorch with `jit_compile=True` (the forward pass through
#   torch.compile) on ViT-B/16 bf16 training (64) and inference (256), in a gpu.py run of its own so that
#   its compiles get the whole share (95 s); then timm eager, timm + torch.compile with fused AdamW
#   (training) and keras_vit's eager PyTorch path on them (100 s); timm + torch.compile inference (50 s).
#   Each gpu.py run writes a folder of its own under the results.
#
# Results: $OUT (the device's returned folder) or benchmarks/results/issue36-<date>/.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
T0=$(date +%s)
TINY=()
PYTHON=${PYTHON:-python3}
if [[ "${1:-}" == "--rehearse" ]]; then
    shift
    PYTHON=${PYTHON_REHEARSE:-python}
    TINY=(--tiny)
    SITE=$(mktemp -d)
    # Pure-Python wheels only (the others are for the GPU machine's Python 3.12).
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" $(ls .whl/*-py3-none-any.whl)
    export PYTHONPATH=$ROOT/benchmarks/gpu/no_tensorflow:$SITE:$ROOT
else
    if ! "$PYTHON" -c "import keras" 2>/dev/null; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 2
    fi
    export PYTHONPATH=/tmp/site:$ROOT
fi
STAGE=${1:-first}
RESULTS=${OUT:-$ROOT/benchmarks/results/issue36-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$RESULTS"
export TF_CPP_MIN_LOG_LEVEL=3 KERAS_BACKEND=jax PYTHONUNBUFFERED=1
left() { echo $((TOTAL - ($(date +%s) - T0))); }
stage() {  # stage NAME SECONDS COMMAND...: at most SECONDS (and what is left of TOTAL)
    local name=$1 seconds=$2
    shift 2
    local limit
    limit=$(left)
    ((seconds < limit)) && limit=$seconds
    if ((limit < 15)); then
        echo "== $name: skipped, $(left) s left" | tee -a "$RESULTS/stages.txt"
        return
    fi
    echo "== $name: up to $limit s (+$(($(date +%s) - T0)) s)" | tee -a "$RESULTS/stages.txt"
    timeout -k 5 "$limit" "$@"
    echo "== $name: exit $? at +$(($(date +%s) - T0)) s" | tee -a "$RESULTS/stages.txt"
}

(nvidia-smi || echo "no nvidia-smi") >"$RESULTS/nvidia-smi.txt" 2>&1
"$PYTHON" -c "import sys, jax, torch, timm, keras; print(sys.version); \
print('jax', jax.__version__, jax.devices()); print('torch', torch.__version__, torch.version.cuda, \
torch.backends.cudnn.version(), torch.cuda.is_available()); print('timm', timm.__version__, 'keras', \
keras.__version__); print('tensorflow imported:', 'tensorflow' in sys.modules)" 2>&1 | tee -a "$RESULTS/nvidia-smi.txt"

if [[ "$STAGE" == "first" ]]; then
    TOTAL=${TOTAL:-405}
    stage experiments 170 "$PYTHON" benchmarks/gpu_experiments.py --output "$RESULTS" --matmul --profile \
        --deadline 160 --cases train_b16_bf16_bs64 infer_b16_bf16_bs256 "${TINY[@]}"
    stage timm_and_torch 160 "$PYTHON" benchmarks/gpu.py --output "$RESULTS" --budget 150 \
        --cases matmul_bf16_8192 matmul_tf32_8192 train_b16_bf16_bs64 infer_b16_bf16_bs256 \
        --competitors timm timm_compiled timm_compiled_fused keras_vit_torch "${TINY[@]}"
    KERAS_BACKEND=torch stage eager_torch_check 40 "$PYTHON" benchmarks/gpu/eager_torch_check.py \
        --output "$RESULTS" "${TINY[@]}"
    LIMIT=$(($(left) - 5))
    ((LIMIT > 75)) && LIMIT=75
    stage input_probe $((LIMIT + 5)) "$PYTHON" benchmarks/input_probe.py --output "$RESULTS" \
        --deadline "$LIMIT" --seconds 2.5 $([[ ${#TINY[@]} -gt 0 ]] && echo "--images 100 --workers 1 2")
elif [[ "$STAGE" == "third" ]]; then
    TOTAL=${TOTAL:-420}
    B16=(train_b16_bf16_bs64 infer_b16_bf16_bs256)
    stage experiments 160 "$PYTHON" benchmarks/gpu_experiments.py --output "$RESULTS" --matmul --profile \
        --deadline 155 --reserve 20 --cases "${B16[@]}" \
        --variants pos_matmul pad_once split_qkv ln_one_pass split_ln "${TINY[@]}"
    stage experiments_s16_l16 110 "$PYTHON" benchmarks/gpu_experiments.py --output "$RESULTS" --deadline 105 \
        --reserve 20 --cases train_s16_bf16_bs128 train_l16_bf16_bs32 --variants pad_once "${TINY[@]}"
    stage experiments_384 60 "$PYTHON" benchmarks/gpu_experiments.py --output "$RESULTS" --deadline 55 \
        --reserve 15 --cases infer_b16_384_bf16_bs64 --variants split_qkv split_ln "${TINY[@]}"
    stage timm_compiled 125 "$PYTHON" benchmarks/gpu.py --output "$RESULTS/timm_compiled" --budget 120 \
        --cases "${B16[@]}" infer_b16_384_bf16_bs64 --competitors timm_compiled_fused timm_compiled "${TINY[@]}"
elif [[ "$STAGE" == "fifth" ]]; then
    TOTAL=${TOTAL:-335}
    B16=(train_b16_bf16_bs64 infer_b16_bf16_bs256)
    stage torch_compiled 95 "$PYTHON" benchmarks/gpu.py --output "$RESULTS/torch_compiled" --budget 90 \
        --cases "${B16[@]}" --competitors keras_vit_torch_compiled "${TINY[@]}"
    stage timm_and_torch 100 "$PYTHON" benchmarks/gpu.py --output "$RESULTS/timm_and_torch" --budget 95 \
        --cases matmul_bf16_8192 "${B16[@]}" --competitors timm timm_compiled_fused keras_vit_torch "${TINY[@]}"
    stage timm_compiled 50 "$PYTHON" benchmarks/gpu.py --output "$RESULTS/timm_compiled" --budget 45 \
        --cases infer_b16_bf16_bs256 --competitors timm_compiled "${TINY[@]}"
elif [[ "$STAGE" == "fourth" ]]; then
    TOTAL=${TOTAL:-330}
    KERAS_BACKEND=torch stage torch_profile 270 "$PYTHON" benchmarks/gpu_torch_profile.py \
        --output "$RESULTS" "${TINY[@]}"
    KERAS_BACKEND=torch stage eager_torch_check 40 "$PYTHON" benchmarks/gpu/eager_torch_check.py \
        --output "$RESULTS" "${TINY[@]}"
else
    TOTAL=${TOTAL:-360}
    for FLAGS in "--xla_gpu_enable_latency_hiding_scheduler=true" "--xla_gpu_enable_triton_gemm=false" \
        "--xla_gpu_enable_command_buffer="; do
        TAG=${FLAGS#--xla_gpu_}
        XLA_FLAGS=$FLAGS stage "xla $TAG" 55 "$PYTHON" benchmarks/gpu_experiments.py --output "$RESULTS" \
            --deadline 50 --reserve 20 --cases train_b16_bf16_bs64 --variants stock --tag "$TAG" "${TINY[@]}"
    done
    # shellcheck disable=SC2086  # S16_VARIANTS: e.g. "stock heads_major"
    stage s16 60 "$PYTHON" benchmarks/gpu_experiments.py --output "$RESULTS" --deadline 55 --reserve 20 \
        --cases train_s16_bf16_bs128 --variants ${S16_VARIANTS:-stock} "${TINY[@]}"
    stage s16_timm 140 "$PYTHON" benchmarks/gpu.py --output "$RESULTS" --budget 130 \
        --cases matmul_bf16_8192 train_s16_bf16_bs128 --competitors timm timm_compiled_fused timm_compiled \
        "${TINY[@]}"
fi
ls -la "$RESULTS"
echo "done at +$(($(date +%s) - T0)) s"
