#!/usr/bin/env bash
# Builds, on this (CPU, online-to-PyPI) machine, the kit that makes vLLM 0.32.0 (or 0.31.0: VLLM=0.31.0) with
# torch 2.13.0 importable on the offline H200 (Python 3.12.3, glibc 2.39, driver 580, its own torch 2.11.0+cu130
# and CUDA 13.0.2 libraries), installed into its own folder (/tmp/site213) so the host's torch stays as it is.
# Usage: scripts/kit213/make_kit.sh OUTDIR        (see scripts/kit213/README.md; ~1.3 GB of downloads,
#        ~22 min here, almost all of it LZMA)
#        scripts/kit213/make_kit.sh OUTDIR --list (the transfer list of a kit built before)
# Knobs (environment):
#   KIT_EXTRA_LIBS="cudnn cublas cusparselt"  also carry torch 2.13's exact cuDNN 9.20.0.48 / cuBLAS 13.1.1.3 /
#                                             cuSPARSELt 0.8.1 (default: none; the host's 9.19 / 13.1.0.3 / 0.8.0
#                                             export every symbol torch 2.13 needs, see README)
#   VLLM=0.32.0 (default) or 0.31.0           the release carried; both pin torch 2.13.0 and torchvision 0.28.0,
#                                             and their other wheels differ only as step 2 says
#   LZMA_PRESET=6   REPACK=1 (0: carry the wheels as PyPI serves them)   PART_MIB=60 (size of one transfer)
# Writes OUTDIR/download (PyPI's wheels), OUTDIR/wheels (repacked), OUTDIR/groups/gNN (one folder per
# transfer), OUTDIR/KIT.txt (what is in it), and prints the transfer list.
set -euo pipefail
out=${1:?usage: scripts/kit213/make_kit.sh OUTDIR [--list]}

transfer_list() {
  local n
  n=$(ls -d "$out"/groups/g* | wc -l)
  echo "== transfer list: $n transfers (copy each OUTDIR/groups/gNN to .kitNN in the checkout)"
  for g in "$out"/groups/g*; do
    printf "  %s -> .kit%s  %6.1f MiB  %s\n" "$(basename "$g")" "${g##*/g}" \
      "$(du -cb "$g"/* | tail -1 | cut -f1 | awk '{print $1 / 1048576}')" "$(ls "$g" | tr '\n' ' ')"
  done
  echo "  total $(du -cb "$out"/groups/g*/* | tail -1 | cut -f1 | awk '{printf "%.1f MiB", $1/1048576}')"
  echo "Each transfer NN (carry [\".kitNN\"]):  mkdir -p /tmp/parts && cp .kitNN/* /tmp/parts/ && (cd /tmp/parts && sha256sum -c --quiet gNN.sha256)"
  echo "The last one (carry [\".kitNN\", <run folders>]):  same, then  bash /tmp/parts/gpu_install.sh && . /tmp/site213/kit213.env && <your run>"
}
if [ "${2:-}" = --list ]; then transfer_list; exit 0; fi
here=$(cd "$(dirname "$0")" && pwd)
extra=${KIT_EXTRA_LIBS:-}
preset=${LZMA_PRESET:-6}
part_mib=${PART_MIB:-60}
mkdir -p "$out/download" "$out/wheels"
rm -rf "$out/groups" "$out/stream"
mkdir -p "$out/groups" "$out/stream"
t_start=$(date +%s)

flags=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
       --platform linux_x86_64 --platform manylinux1_x86_64 --platform manylinux2010_x86_64
       --platform manylinux2014_x86_64)
for minor in $(seq 5 39); do flags+=(--platform "manylinux_2_${minor}_x86_64"); done   # glibc 2.39 on the H200

# 1. The torch stack. torch 2.13.0 pins cuda-toolkit 13.0.3 (only cuBLAS differs from the host's 13.0.2),
#    cuDNN 9.20.0.48, NCCL 2.29.7, cuSPARSELt 0.8.1, NVSHMEM 3.4.5 (the host's), triton 3.7.1, and
#    cuda-bindings >=13.0.3,<14 (the host's 13.3.1). NCCL must travel: libtorch_cuda.so needs 8 functions
#    that NCCL 2.28.9 lacks (ncclCommSuspend, ncclCommResume, ...), so `import torch` fails without it.
torch_stack=(torch==2.13.0 triton==3.7.1 torchvision==0.28.0 nvidia-nccl-cu13==2.29.7)
for lib in $extra; do
  case $lib in
    cudnn) torch_stack+=(nvidia-cudnn-cu13==9.20.0.48) ;;
    cublas) torch_stack+=(nvidia-cublas==13.1.1.3) ;;
    cusparselt) torch_stack+=(nvidia-cusparselt-cu13==0.8.1) ;;
    *) echo "KIT_EXTRA_LIBS: unknown library '$lib' (cudnn, cublas, cusparselt)" >&2; exit 2 ;;
  esac
done
# 2. vLLM 0.32.0 and what its engine imports (every engine, Qwen3.5, GDN, spec-decode and sampler module,
#    checked offline with import_check.py) beyond the image's numpy, pillow, requests, tqdm, regex, pyyaml,
#    packaging, filelock, fsspec, jinja2, sympy, networkx, safetensors, typer/click/rich, psutil, setuptools,
#    httpx/anyio. Versions: what `pip install vllm==0.32.0 torchvision==0.28.0` resolved on 2026-12-04.
#    transformers 5.19.0 (vLLM pins >=5.16.1,<5.20; the image's 5.17 would do, 5.19 matches the CPU
#    environment) checks huggingface-hub>=1.31 when imported, and hub 2.4 brings httpx2/httpcore2/truststore.
#    vLLM 0.31.0 (VLLM=0.31.0) pins transformers <5.18 and xgrammar 0.2.7; `pip install vllm==0.31.0
#    torchvision==0.28.0` resolved (2026-12-05) transformers 5.17.0 with huggingface-hub 1.33.0 (which talks
#    through httpx, httpcore and hf-xet) and otherwise the same versions as 0.32.0's; httpx2 stays for openai.
case ${VLLM:-0.32.0} in
  0.32.0) release_pkgs=(vllm==0.32.0 xgrammar==0.2.8 transformers==5.19.0 huggingface-hub==2.4.0
                        httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5) ;;
  0.31.0) release_pkgs=(vllm==0.31.0 xgrammar==0.2.7 transformers==5.17.0 huggingface-hub==1.33.0
                        httpx==0.29.0 httpcore==1.0.9 hf-xet==1.8.0
                        httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5) ;;   # httpx2: openai 3.63's
  *) echo "VLLM: unknown release '$VLLM' (0.32.0, 0.31.0)" >&2; exit 2 ;;
esac
python_pkgs=("${release_pkgs[@]}" tokenizers==0.23.3
  click==8.5.1 h11==0.16.0 anyio==4.16.0 idna==3.20 sniffio==1.3.1
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5
  typing-extensions==4.16.0
  apache-tvm-ffi==0.1.11 llguidance==1.7.6 compressed-tensors==0.17.0 loguru==0.7.3
  blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 msgspec==0.23.0 pybase64==1.5.1 pyzmq==27.3.0
  partial-json-parser==0.2.1.1.post7 fastapi==0.136.3 starlette==1.10.0 openai==3.63.0 jiter==0.19.0
  oss-harmony==0.0.11 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0
  multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 cloudpickle==3.1.3 einops==0.8.2 uvloop==0.23.0
  py-cpuinfo==9.0.0 prometheus-client==0.26.0 setproctitle==1.3.8
  numba==0.65.0 llvmlite==0.47.0)   # numba: the `ngram` (CPU) proposer of the incident matrix
echo "== download (${#torch_stack[@]} + ${#python_pkgs[@]} wheels)"
python3 -m pip download -q "${flags[@]}" -d "$out/download" "${torch_stack[@]}" "${python_pkgs[@]}"
n_expected=$(( ${#torch_stack[@]} + ${#python_pkgs[@]} ))
# Only the wheels asked for now (OUTDIR/download may hold others from an earlier run with other knobs).
python3 - "$out/download" "$out/wheels.list" "${torch_stack[@]}" "${python_pkgs[@]}" <<'EOF'
import os, re, sys
folder, listing, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
files = os.listdir(folder)
chosen = []
for spec in specs:
    name, version = spec.split("==")
    hits = [f for f in files if f.endswith(".whl") and norm(f.split("-")[0]) == norm(name) and f.split("-")[1] == version]
    if len(hits) != 1:
        sys.exit(f"expected one wheel for {spec} in {folder}, found {hits}")
    chosen.append(hits[0])
open(listing, "w").write("\n".join(chosen) + "\n")
EOF
[ "$(wc -l < "$out/wheels.list")" -eq "$n_expected" ]
t_dl=$(date +%s)

# 3. Repack with LZMA where it pays (members DEFLATE already shrinks to < 60%: host code, Python, text).
echo "== repack (LZMA preset $preset) into $out/wheels"
: > "$out/sizes.txt"
while read -r w; do
  before=$(stat -c %s "$out/download/$w")
  stamp="$out/wheels/.$w.done-preset$preset-repack${REPACK:-1}"
  if [ -f "$stamp" ] && [ -f "$out/wheels/$w" ]; then
    echo "$w: repacked before, reused"
  elif [ "${REPACK:-1}" = 1 ] && [ "$before" -gt 1048576 ]; then
    rm -f "$out/wheels/.$w.done-"*
    python3 "$here/repack_lzma.py" --preset "$preset" "$out/download/$w" "$out/wheels/$w" | tee -a "$out/repack.log"
    [ "$(stat -c %s "$out/wheels/$w")" -lt "$before" ] || cp "$out/download/$w" "$out/wheels/$w"
    touch "$stamp"
  else
    rm -f "$out/wheels/.$w.done-"*
    cp "$out/download/$w" "$out/wheels/$w"; touch "$stamp"
  fi
  echo "$w $before $(stat -c %s "$out/wheels/$w")" >> "$out/sizes.txt"
done < "$out/wheels.list"
t_rp=$(date +%s)

# 4. Checksums, one stream of all wheels, cut into PART_MIB parts: one part per transfer.
# A part is 4 KiB short of PART_MIB so that a group (part + its .sha256) stays within PART_MIB.
limit=$(( part_mib * 1048576 ))
mapfile -t kit_wheels < "$out/wheels.list"
(cd "$out/wheels" && sha256sum "${kit_wheels[@]}" > SHA256SUMS)
echo "== stream and split into parts of ${part_mib} MiB - 4 KiB"
(cd "$out/wheels" && tar -cf - SHA256SUMS "${kit_wheels[@]}") | split -b $(( limit - 4096 )) -a 3 -d - "$out/stream/kit213.tar.part-"
(cd "$out/stream" && sha256sum kit213.tar.part-* > PARTS.SHA256SUMS)
parts=("$out"/stream/kit213.tar.part-*)
n=${#parts[@]}
for i in $(seq 1 "$n"); do
  g=$(printf "g%02d" "$i"); p=${parts[$((i-1))]}
  mkdir -p "$out/groups/$g"
  mv "$p" "$out/groups/$g/"
  (cd "$out/groups/$g" && sha256sum "$(basename "$p")" > "$g.sha256")
done
# The install files ride with the last part when they fit, else in a group of their own.
last="$out/groups/$(printf "g%02d" "$n")"
extras=("$here/gpu_install.sh" "$here/import_check.py" "$out/stream/PARTS.SHA256SUMS")
extra_bytes=$(cat "${extras[@]}" | wc -c)
if [ $(( $(du -cb "$last"/* | tail -1 | cut -f1) + extra_bytes )) -gt "$limit" ]; then
  n=$((n + 1)); last="$out/groups/$(printf "g%02d" "$n")"; mkdir -p "$last"
fi
cp "${extras[@]}" "$last/"
t_end=$(date +%s)

# 5. What is in the kit, and the transfer list.
python3 - "$out" "$preset" <<'EOF' | tee "$out/KIT.txt"
import os, sys
out, preset = sys.argv[1], sys.argv[2]
rows = [line.split() for line in open(os.path.join(out, "sizes.txt"))]
mib = lambda b: int(b) / 2**20
print(f"{'wheel':74s} {'PyPI MiB':>9s} {'kit MiB':>8s}")
for name, before, after in sorted(rows, key=lambda r: -int(r[1])):
    print(f"{name:74s} {mib(before):9.1f} {mib(after):8.1f}")
b, a = sum(int(r[1]) for r in rows), sum(int(r[2]) for r in rows)
print(f"{'total (' + str(len(rows)) + ' wheels, LZMA preset ' + preset + ')':74s} {mib(b):9.1f} {mib(a):8.1f}")
EOF
echo
transfer_list
echo "== times: download $((t_dl - t_start)) s, repack $((t_rp - t_dl)) s, split $((t_end - t_rp)) s, all $((t_end - t_start)) s"
