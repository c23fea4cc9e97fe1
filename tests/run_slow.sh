#!/usr/bin/env bash
# The slow tier, every test marked `slow`: on TensorFlow (subprocess training, resume and multi-process
# runs, distributed runs, SavedModel serving, every docs page's code, converter parity on ViT-S/B, XLA),
# then the backend-neutral modules' slow tests (the bigger models' parity) on JAX and on PyTorch. Not in
# CI, which runs tests/run_all.sh (the quick tier) to stay short; run it by hand after changing the training
# driver, the docs, the converters or the export, and before a release (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q -rs -m slow "$@"
KERAS_BACKEND=jax python -m pytest -q -rs -m slow "$@"
KERAS_BACKEND=torch python -m pytest -q -rs -m slow "$@"
