#!/bin/bash
# On the H200, once the 18 kit transfers are in /tmp/parts (scripts/kit213/README.md): the project's offline
# setup from the notebook tools' wheels (WHEEL_DIR, scripts/offline_wheels.sh's `project` folder), the venv of
# ENV (v0.32.0-h200, or v0.31.0-h200 from a VLLM=0.31.0 kit) from the kit's wheels (make venv), then the
# reproduce chapter through make run with environments/runs/ENV-reproduce.yaml, stopped after SECONDS (a remote
# command lasts at most 10 minutes: a later call resumes, given the records written so far).
# Each step is skipped when a call on the same held host already did it. The records are kept in
# /tmp/h200-records between calls on the same held host (the next call's copy of the checkout lacks them)
# and packed into $OUT/records.tgz with the run's log, so none is lost when a call ends at its limit.
# SECONDS=0 does one setup step per call (the project's .venv, the join, make venv, in that order) and returns;
# once all three are done it checks (torch on the GPU, vLLM's version, memory and disk) and prints
# "h200_reproduce: ready". On 2026-12-05 the host stopped answering ~8 min into one call that set up and ran,
# and nothing came back: a step in a call of its own names the step a dying host died in, and every earlier
# step's output has come back. Then run the matrix in calls of a few minutes each (each returns its records).
# ENV without a card (v0.32.0, v0.31.0) takes the card from nvidia-smi: v0.32.0-h100 on an H100, -h200 on an H200.
# A step's output goes to /tmp/reproduce-steps/NAME.log; a step that a call left unfinished is reported (memory,
# disk, the log's last lines) before it is tried again.
# Usage: bash scripts/kit213/h200_reproduce.sh WHEEL_DIR [SECONDS] [ENV]
set -euo pipefail
wheels=${1:?usage: scripts/kit213/h200_reproduce.sh WHEEL_DIR [SECONDS] [ENV]}
seconds=${2:-480}
env=${3:-v0.32.0}
if [[ $env != *-h[0-9]* ]]; then
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h[0-9]{3}' | tr 'H' 'h')
  [ -n "$card" ] || { echo "h200_reproduce: no H100/H200 named by nvidia-smi; give ENV" >&2; exit 2; }
  env=$env-$card
fi
echo "h200_reproduce: environment $env"
t0=$(date +%s)
keep=/tmp/h200-records
logs=/tmp/reproduce-steps
mkdir -p "$keep" "$logs" results/measured && cp -a "$keep"/. results/measured/
step() {  # step NAME TEST PATH COMMAND...: runs COMMAND unless `[ TEST PATH ]` holds; in a setup call, one step only
  local name=$1 test=$2 path=$3; shift 3
  if [ "$test" "$path" ]; then return 0; fi
  local log="$logs/${name// /_}.log"
  if [ -f "$log" ]; then
    echo "h200_reproduce: step '$name' was left unfinished by an earlier call; memory, disk, its last lines:"
    free -g | head -2; df -h /tmp | tail -n +2; tail -n 20 "$log"
  fi
  echo "h200_reproduce: step '$name' starts"
  "$@" > "$log" 2>&1 || { tail -n 40 "$log"; echo "h200_reproduce: step '$name' failed" >&2; exit 1; }
  tail -n 5 "$log"; rm -f "$log"
  echo "h200_reproduce: step '$name' done after $(( $(date +%s) - t0 )) s"
  if [ "$seconds" = 0 ]; then exit 0; fi
}
step "project .venv" -f .venv/.setup-stamp bash scripts/offline_setup.sh "$wheels"
step "join" -d /tmp/parts/wheels env JOIN_ONLY=1 bash /tmp/parts/gpu_install.sh
step "make venv" -x ".venvs/$env/bin/python" make venv ENV="$env" WHEELS=/tmp/parts/wheels
echo "h200_reproduce: set up in $(( $(date +%s) - t0 )) s"
if [ "$seconds" = 0 ]; then
  ".venvs/$env/bin/python" -c "import torch, vllm; print('torch', torch.__version__, torch.zeros(1).cuda().device,
      '| vllm', vllm.__version__)"
  free -g | head -2; df -h . /tmp | tail -n +2
  echo "h200_reproduce: ready"
  exit 0
fi
status=0
log=${OUT:-/tmp}/make-run.log
timeout "$seconds" make run CHAPTER=reproduce ENV="$env" \
  PARAMS="environments/runs/$env-reproduce.yaml" > "$log" 2>&1 || status=$?
tail -c 6000 "$log"
echo "h200_reproduce: make run exit status $status after $(( $(date +%s) - t0 )) s"
shopt -s nullglob
made=(results/measured/"$env"-*)
if [ ${#made[@]} -gt 0 ]; then
  cp -a "${made[@]}" "$keep"/
  [ -z "${OUT:-}" ] || tar -czf "$OUT/records.tgz" "${made[@]}"
fi
echo "h200_reproduce: $(find "$keep" -name '*.json' | wc -l) records kept in $keep"
