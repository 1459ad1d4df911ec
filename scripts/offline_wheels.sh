#!/usr/bin/env bash
# Downloads, on a machine with pip access, the wheels an offline GPU host needs for the vLLM chapter
# when its image already has torch 2.11 (CUDA 13), transformers, pandas and matplotlib (the team's H200;
# Python 3.12, x86-64). Usage: scripts/offline_wheels.sh OUTDIR   (~300 MiB)
#   OUTDIR/vllm     vLLM 0.26.0 (the last release pinning torch 2.11) and what its engine imports that
#                   the image lacks (measured on the H200: every engine, model and spec-decode module imports)
#   OUTDIR/project  papermill and its kernel, myst-nb's glue (with docutils), jsonschema, flash-linear-attention
set -euo pipefail
out=${1:?usage: scripts/offline_wheels.sh OUTDIR}
flags=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
       --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_27_x86_64
       --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
       --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
python3 -m pip download -q "${flags[@]}" -d "$out/vllm" \
  vllm==0.26.0 annotated_types==0.8.0 apache_tvm_ffi==0.1.10 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 \
  compressed_tensors==0.17.0 distro==1.9.0 fastapi==0.136.3 llguidance==1.7.6 loguru==0.7.3 msgspec==0.23.0 \
  openai==2.54.0 openai_harmony==0.0.8 partial_json_parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 \
  pydantic_core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 typing_extensions==4.16.0 \
  typing_inspection==0.4.5 xgrammar==0.2.7
# The versions of requirements.txt, for what the notebooks import beyond the image.
python3 -m pip download -q "${flags[@]}" -d "$out/project" \
  papermill==2.7.0 nbformat==5.11.1 nbclient==0.11.0 ipykernel==7.4.0 ipython==9.18.1 ipython_pygments_lexers==1.1.1 \
  jupyter_client==8.10.0 jupyter_core==5.9.1 traitlets==5.16.1 tornado==6.6.1 comm==0.2.3 debugpy==1.8.22 \
  matplotlib-inline==0.2.2 nest-asyncio2==1.7.4 jedi==0.20.1 parso==0.8.7 prompt_toolkit==3.0.53 wcwidth==0.9.4 \
  pexpect==4.9.0 ptyprocess==0.7.0 stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4 \
  entrypoints==0.4.2 fastjsonschema==2.22.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
  referencing==0.37.0 rpds-py==2026.9.1 tenacity==9.2.1 myst-nb==1.4.0 platformdirs==4.14.9 \
  importlib_metadata==10.2.0 pyzmq==27.3.0 flash-linear-attention==0.6.0 fla-core==0.6.0 \
  docutils==0.21.2   # myst-nb's glue imports it (the 2026-12-04 H200 run failed there, after the matrix)
du -sh "$out"/*
