#!/bin/bash
# The main job (keras-vit train, its defaults) on JAX, seeds 0-4, at the current main.
source /work/main/.venv/bin/activate
lscpu > lscpu.txt
git -C /work/main rev-parse HEAD > commit.txt
for S in 0 1 2 3 4; do
  d=jax-s$S
  [ -f $d/report.json ] && continue
  KERAS_BACKEND=jax /usr/bin/time -f "%e s wall, %U s user, %S s sys" -o $d.time \
    keras-vit train --seed $S --output-dir $d --verbose 0 > $d.log 2>&1
done
