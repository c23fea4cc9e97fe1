#!/bin/bash
# The main job (keras-vit train, its defaults: 100 passes of the digits) on TensorFlow and JAX,
# seeds 0-4, the backends interleaved per seed; each run's report.json was copied here as
# BACKEND-sS.json and /usr/bin/time's line as BACKEND-sS.time. Run from a folder of its own.
source "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)/.venv/bin/activate"
lscpu > lscpu.txt
for S in 0 1 2 3 4; do
  for B in tensorflow jax; do
    d=$B-s$S
    [ -f $d/report.json ] && continue
    KERAS_BACKEND=$B /usr/bin/time -f "%e s wall, %U s user, %S s sys" -o $d.time \
      keras-vit train --seed $S --output-dir $d --verbose 0 > $d.log 2>&1
  done
done
