#!/usr/bin/env bash
# The test command (README, .ci/run): the whole suite on TensorFlow, then the backend-neutral modules'
# quick tests on JAX and on PyTorch (tests/conftest.py's BACKEND_NEUTRAL_MODULES; their slow tests,
# the bigger models' parity, are left out to keep CI short: run them by hand with
# KERAS_BACKEND=jax|torch python -m pytest -q -m "slow or not slow"). -rs lists every skip;
# tests/conftest.py fails a skip the set-up should have run, and a run that collects no test.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q -rs "$@"
KERAS_BACKEND=jax python -m pytest -q -rs -m "not slow" "$@"
KERAS_BACKEND=torch python -m pytest -q -rs -m "not slow" "$@"
