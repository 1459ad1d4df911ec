#!/bin/bash
# On the H200, once the 18 kit transfers are in /tmp/parts (scripts/kit213/README.md): the project's offline
# setup from the notebook tools' wheels (WHEEL_DIR, scripts/offline_wheels.sh's `project` folder), vLLM 0.32.0's
# venv from the kit (make venv), then the reproduce chapter through make run, stopped after SECONDS (a remote
# command lasts at most 10 minutes: a later call resumes, given the records written so far).
# Each step is skipped when a call on the same held host already did it.
# Usage: bash scripts/kit213/h200_reproduce.sh WHEEL_DIR [SECONDS]
set -euo pipefail
wheels=${1:?usage: scripts/kit213/h200_reproduce.sh WHEEL_DIR [SECONDS]}
seconds=${2:-480}
t0=$(date +%s)
[ -f .venv/.setup-stamp ] || bash scripts/offline_setup.sh "$wheels"
[ -d /tmp/parts/wheels ] || JOIN_ONLY=1 bash /tmp/parts/gpu_install.sh
[ -x .venvs/v0.32.0-h200/bin/python ] || make venv ENV=v0.32.0-h200 WHEELS=/tmp/parts/wheels
echo "h200_reproduce: set up in $(( $(date +%s) - t0 )) s"
status=0
timeout "$seconds" make run CHAPTER=reproduce ENV=v0.32.0-h200 \
  PARAMS=environments/runs/v0.32.0-h200-reproduce.yaml || status=$?
echo "h200_reproduce: make run exit status $status after $(( $(date +%s) - t0 )) s"
