#!/usr/bin/env bash
# For iterating: ruff and the quick tier (every test not marked `slow`) on TensorFlow, JAX and PyTorch;
# tests/run_all.sh (the test command, CI) adds the slow tier. Every section runs; the failed ones are named.
TIERS=quick exec bash "$(dirname "$0")/run_all.sh" "$@"
