#!/usr/bin/env bash
# Debian packages restage needs on a fresh machine: SLURM and munge for the local one-node
# cluster that the SLURM tests and `.ci/run` start. Idempotent; skips apt when all are present.
set -euo pipefail
pkgs=(slurmctld slurmd slurm-client munge)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "restage: missing Debian packages ${missing[*]}; run as root or install them" >&2
    exit 2
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi
