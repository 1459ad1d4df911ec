#!/bin/bash
# On the H200, once every transfer's files were copied into /tmp/parts: check the parts, join them, check the
# wheels, install them into their own folder (TARGET, default /tmp/site213; the host's torch 2.11 and its
# site-packages are not touched), write TARGET/kit213.env and run import_check.py.
# Then:  . /tmp/site213/kit213.env && python3 ...      (import torch gives 2.13.0+cu130 there, 2.11 elsewhere)
# Knobs: TARGET=/tmp/site213  PARTS=/tmp/parts  CHECK=1 (0: skip the import check)  JOIN_ONLY=1 (stop after the wheels are in
# PARTS/wheels, e.g. to install them into a venv with --system-site-packages instead)
set -euo pipefail
target=${TARGET:-/tmp/site213}
parts=${PARTS:-/tmp/parts}
cd "$parts"
t0=$(date +%s)
python3 -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
  || { echo "gpu_install: the kit holds cp312 wheels; python3 is not 3.12" >&2; exit 2; }
# 1. Every part here and intact, then the wheels out of the joined stream.
if ls kit213.tar.part-* >/dev/null 2>&1; then
  sha256sum -c --quiet PARTS.SHA256SUMS
  mkdir -p wheels
  cat kit213.tar.part-* | tar -xf - -C wheels
  rm -f kit213.tar.part-*
fi
(cd wheels && sha256sum -c --quiet SHA256SUMS)
t1=$(date +%s)
echo "gpu_install: $(ls wheels/*.whl | wc -l) wheels checked in $((t1 - t0)) s"
[ "${JOIN_ONLY:-0}" = 1 ] && exit 0
# 2. Install: four pip runs side by side (LZMA members unpack at ~100 MB/s a core), each into a staging
#    folder, then merged by hard links. torch and the nvidia-* libraries go to the same folder: torch finds
#    them there by its RPATH ($ORIGIN/../../nvidia/...), the rest it preloads from the host's site-packages.
rm -rf "$target" "$target.stage"
mkdir -p "$target.stage"
declare -A sets=(
  [a]="$(ls wheels/torch-*.whl wheels/nvidia_*.whl)"
  [b]="$(ls wheels/vllm-*.whl)"
  [c]="$(ls wheels/triton-*.whl)"
  [d]="$(ls wheels/*.whl | grep -v -e '/torch-' -e '/nvidia_' -e '/vllm-' -e '/triton-')"
)
pids=()
for k in a b c d; do
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$target.stage/$k" ${sets[$k]} > "$target.stage/$k.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do wait "${pids[$i]}" || failed=1; done
if [ "$failed" = 1 ]; then cat "$target.stage"/*.log >&2; exit 1; fi
mkdir -p "$target"
for k in a b c d; do cp -al --remove-destination "$target.stage/$k/." "$target/"; done
rm -rf "$target.stage"
t2=$(date +%s)
# 3. The environment a run needs. cuDNN: torch 2.13 was built against 9.20; unless the kit carried it, the
#    host's 9.19 is used (same 226 exported functions) and torch's minor-version check must be skipped.
{
  echo "export PYTHONPATH=$target\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "export VLLM_USE_FLASHINFER_SAMPLER=0   # flashinfer is not carried"
  if ! ls "$target"/nvidia_cudnn_cu13-9.20.0.48.dist-info >/dev/null 2>&1; then
    echo "export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1   # host cuDNN 9.19 under torch built with 9.20"
  fi
} > "$target/kit213.env"
echo "gpu_install: installed into $target in $((t2 - t1)) s ($(du -sh "$target" | cut -f1)); env: $target/kit213.env"
if [ "${CHECK:-1}" = 1 ]; then
  # shellcheck disable=SC1091
  (. "$target/kit213.env" && python3 "$parts/import_check.py") 2>&1 | grep -v '^ok ' || true
  echo "gpu_install: import check took $(( $(date +%s) - t2 )) s"
fi
