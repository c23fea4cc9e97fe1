#!/usr/bin/env bash
# The test command (README, .ci/run): the quick tier, every test not marked `slow`, on TensorFlow, then the
# backend-neutral modules' quick tests on JAX and on PyTorch (tests/conftest.py's BACKEND_NEUTRAL_MODULES).
# The slow tier (subprocess training, resume and multi-process runs, SavedModel serving, the docs pages,
# the bigger models' parity) is tests/run_slow.sh: too long for CI, run by hand. -rs lists every skip;
# tests/conftest.py fails a skip the set-up should have run, and a run that collects no test.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q -rs -m "not slow" "$@"
KERAS_BACKEND=jax python -m pytest -q -rs -m "not slow" "$@"
KERAS_BACKEND=torch python -m pytest -q -rs -m "not slow" "$@"
