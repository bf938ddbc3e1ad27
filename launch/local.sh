#!/usr/bin/env bash
# Train on this machine: NPROC ranks (default 2), any Hydra overrides after.
#   launch/local.sh                      # the default job on 2 CPU ranks
#   NPROC=8 launch/local.sh precision=bf16-mixed
set -euo pipefail
exec torchrun --standalone --nproc_per_node="${NPROC:-2}" -m dist_trainer "$@"
