#!/usr/bin/env bash
# Debian's Slurm daemons and client, for tests/scripts/test_slurm.py, which starts a one-node Slurm of its own
# (slurmctld and slurmd on free ports, auth/none: no munge) and submits scripts/slurm/engine.sbatch to it.
# Skipped when they are installed; CI runs as root on Debian.
#   bash .ci/slurm.sh
set -euo pipefail
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client
fi
