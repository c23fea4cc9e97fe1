#!/usr/bin/env bash
# The test command (README, .ci/run): ruff, then every test on every backend, section by section: the
# quick tier (every test not marked `slow`) on TensorFlow, JAX and PyTorch, then the slow tier (subprocess
# training, resume and multi-process runs, SavedModel serving, the docs pages, the bigger models' parity)
# on the same three. Under KERAS_BACKEND=jax|torch pytest collects the backend-neutral modules only
# (tests/conftest.py's BACKEND_NEUTRAL_MODULES). Every section runs even when one fails; the command
# fails at the end, naming the sections that failed. -rs lists every skip; tests/conftest.py fails a skip
# it does not expect, and a run that collects no test. Arguments go to every pytest run (e.g. -x, -k).
# TIERS="quick" (tests/run_quick.sh) or TIERS="slow" (tests/run_slow.sh) runs one tier only;
# SKIP_SECTIONS="JAX slow,PyTorch slow" leaves those sections out (e.g. a quick check of one backend), named at
# the end as not run; CI (.ci/run) leaves none out.
set -uo pipefail
cd "$(dirname "$0")/.."
TIERS=${TIERS:-quick slow}
SKIP_SECTIONS=${SKIP_SECTIONS:-}
failed=()
skipped=()

section() {  # section NAME COMMAND...: run the command, note NAME if it fails
    local name=$1 start=$SECONDS
    shift
    if [[ ",${SKIP_SECTIONS}," == *",${name},"* ]]; then
        skipped+=("${name}")
        return
    fi
    echo "=== ${name}"
    if ! "$@"; then
        failed+=("${name}")
    fi
    echo "=== ${name}: $((SECONDS - start)) s"
}

section "ruff check" python -m ruff check keras_vit tests benchmarks examples
section "ruff format" python -m ruff format --check keras_vit tests benchmarks examples
for tier in ${TIERS}; do
    case ${tier} in
        quick) marker="not slow" ;;
        slow) marker="slow" ;;
        *) echo "tests/run_all.sh: unknown tier '${tier}' in TIERS: use quick, slow or both" >&2; exit 2 ;;
    esac
    section "TensorFlow ${tier}" env KERAS_BACKEND=tensorflow python -m pytest -q -rs -m "${marker}" "$@"
    section "JAX ${tier}" env KERAS_BACKEND=jax python -m pytest -q -rs -m "${marker}" "$@"
    section "PyTorch ${tier}" env KERAS_BACKEND=torch python -m pytest -q -rs -m "${marker}" "$@"
done

if ((${#skipped[@]})); then
    printf -v list '%s, ' "${skipped[@]}"
    echo "NOT RUN (SKIP_SECTIONS): ${list%, }"
fi
if ((${#failed[@]})); then
    printf -v list '%s, ' "${failed[@]}"
    echo "FAILED: ${#failed[@]} section(s): ${list%, }" >&2
    exit 1
fi
echo "all sections passed (${TIERS})"
