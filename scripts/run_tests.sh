#!/usr/bin/env bash
# Runs the whole suite; pytest's exit code 5 (no tests collected) is a failure, not green.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "restage: pytest collected no tests" >&2; exit 1; fi
exit $rc
