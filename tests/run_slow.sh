#!/usr/bin/env bash
# The slow tier only (every test marked `slow`) on TensorFlow, JAX and PyTorch, after ruff; part of
# tests/run_all.sh (the test command, CI). Every section runs; the failed ones are named at the end.
TIERS=slow exec bash "$(dirname "$0")/run_all.sh" "$@"
