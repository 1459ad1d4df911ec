"""The reproduction chapter's runner: a configuration matrix through vLLM, one child process per engine.

Before any engine starts, everything is checked: the matrix, the model path, that the target
interpreter has vLLM, and that this vLLM accepts every engine argument and speculative method of the
matrix. Then each configuration runs in its own process (spectie.engines.child): one engine, reused
for all its repeats of every prompt (one record per configuration and prompt seed). A configuration
that vLLM refuses with one of its known refusal messages becomes `status: unsupported`; any other
failure (a crash, an out-of-memory, a harness error) becomes `crashed`, with the traceback's last lines;
the matrix goes on. If the baseline fails, nothing can be compared: the matrix stops and says why.
Each configuration's records are written as soon as it finishes; a later run with the same request
skips it (resume after an interruption).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

from spectie.engines.child import MARKER, V2_ONLY_FROM, release_key
from spectie.errors import UsageError
from spectie.engines.matrix import EXPECTED_STATUSES, EngineConfig, Matrix
from spectie.paths import project_root

CHAPTER = "reproduce"
TAIL_LINES = 30  # lines of the child's log kept in a record of a failed configuration
OUT_OF_MEMORY = ("OutOfMemoryError", "MemoryError")
ENGINE_CORE_FAILED = "Engine core initialization failed"  # all a caller sees of a failure in vLLM's engine process
# vLLM's own words when it refuses a configuration while setting up the engine (seen in its 0.26-0.32
# sources and records): only these make a configuration `unsupported`. Anything else is `crashed`.
REFUSALS = (
    r"\bnot supported\b",                          # "VLLM batch_invariant mode is not supported for GDN_ATTN."
    r"\bdoes not support\b|\bunsupported\b",      # "... does not support ...", "Unsupported speculative method"
    r"Model Runner V2 requires",                    # "Model Runner V2 requires Triton."
    r"requires a CUDA or other accelerator backend",  # ngram_gpu's pinned memory on a CPU-only platform
    r"only supports|is only supported|only available",
)


# ----------------------------------------------------------------------------------------- checks
def engine_python(environment: str) -> Path:
    """The interpreter whose vLLM runs the engines: this one for `cpu`, else the environment's venv."""
    if environment == "cpu":
        return Path(sys.executable)
    return project_root() / ".venvs" / environment / "bin" / "python"


def child_environment(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    root = str(project_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


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
                from spectie.records import write_text_atomic

                write_text_atomic(kept, probe)
            return json.loads(probe)
    tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-5:])
    raise UsageError(f"environment {environment!r}: vLLM does not import in {python}; {hint}\n{tail}")


def probe_key(python: Path) -> str | None:
    """What a probe depends on: the interpreter, the packages installed beside it (their names carry their
    versions), the probing code, this machine and the GPUs it is shown. None where the packages cannot be listed
    (then every call probes)."""
    import hashlib

    from spectie.fingerprint import host_id

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
    from spectie.prompts import PromptSpec, build_prompt as build
    from spectie.tokenizer import model_tokenizer

    spec = PromptSpec(tokens=tokens, seed=seed, template=template).check()
    return build(spec, model_tokenizer(model_path))


# ---------------------------------------------------------------------------------------- running
@dataclass
class Outcome:
    """What one child process reported."""

    status: str = "ok"  # ok | unsupported | crashed | interrupted
    vllm_version: str | None = None
    engine_seconds: float | None = None
    model_runner: str | None = None
    platform: str | None = None
    repeats: list[dict] = field(default_factory=list)
    error: dict | None = None
    log_tail: list[str] = field(default_factory=list)
    seconds: float = 0.0


def engine_kwargs(config: EngineConfig, matrix: Matrix, model: str, extra_engine: dict | None = None) -> dict:
    """`vllm.LLM` arguments of one configuration: its own, the matrix's shared ones, then `extra_engine`."""
    engine = {**matrix.engine, **(extra_engine or {})}
    return config.llm_kwargs(model, engine.pop("dtype", "auto"), **engine)


def request_for(config: EngineConfig, matrix: Matrix, model: str, prompts: list[list[int]],
                extra_engine: dict | None = None, sequential: bool = True) -> dict:
    """What the engine child runs: `repeats` generations of each prompt, one request at a time
    (`sequential`, as the incident ran) or all prompts as one batch."""
    kwargs = engine_kwargs(config, matrix, model, extra_engine)
    kwargs.setdefault("disable_log_stats", False)  # speculative acceptance counters
    return {"llm_kwargs": kwargs, "sampling": config.sampling_kwargs(), "prompts": [list(p) for p in prompts],
            "sequential": sequential, "repeats": config.repeats, "tail_tokens": 8,
            "environment": {**matrix.environment, **config.environment()}}


# The files whose code runs an engine and summarizes its outcome (with the weights, the request and vLLM's version:
# a run's measurement key).
RUN_SOURCES = ("spectie/engines/runner.py", "spectie/engines/child.py", "spectie/tiestop.py")


def request_key(request: dict, vllm_version: str) -> str:
    """Identity of a run: the same weights (by digest, wherever they lie), engine arguments, prompts, sampling,
    repeats, vLLM and code (`fingerprint.measurement_key`); a record holding it is reused, not run again."""
    from spectie.fingerprint import measurement_key

    kwargs = dict(request["llm_kwargs"])
    model = kwargs.pop("model")
    return measurement_key("engine-outcome", model, {**request, "llm_kwargs": kwargs, "vllm_version": vllm_version},
                           RUN_SOURCES)


_RUNNING: set = set()  # engine processes running now (killed together on an interruption)


def kill_running() -> None:
    for process in list(_RUNNING):
        try:
            os.killpg(process.pid, 9)
        except ProcessLookupError:
            pass


def slot_environment(slot: int, parallel: int, platform: str) -> dict:
    """Engines that run side by side on a CPU each get a core of their own (`slot`).

    Two CPU engines that both bind their OpenMP threads to core 0 (vLLM's automatic binding) spin
    against each other and hang; one core each runs them in the time of one (measured on 2 cores).
    """
    if parallel < 2 or platform != "cpu":
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": str(slot % (os.cpu_count() or 1)), "OMP_NUM_THREADS": "1"}


def run_child(python: Path, request: dict, log_path: Path, on_event=lambda event: None,
              cancelled=lambda: False, extra_environment: dict | None = None) -> Outcome:
    """Run one configuration in a child process; every event is passed to `on_event` as it arrives.

    Ctrl-C (here, or `cancelled()` turning true after kill_running()) kills the engine and returns
    what finished, with status `interrupted`.
    """
    outcome, tail = Outcome(), deque(maxlen=TAIL_LINES)
    finished = False  # the child reported `done`: every repeat of every prompt
    started = time.monotonic()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(request, handle)
    command = [str(python), "-m", "spectie.engines.child", "run", handle.name]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=child_environment({**request["environment"], **(extra_environment or {})}),
                               start_new_session=True)
    _RUNNING.add(process)
    try:
        with log_path.open("w", encoding="utf-8") as log:
            for line in process.stdout:
                if not line.startswith(MARKER):
                    log.write(line)
                    tail.append(line.rstrip("\n"))
                    continue
                event = json.loads(line[len(MARKER):])
                kind = event.pop("event")
                if kind == "started":
                    outcome.vllm_version = event["vllm_version"]
                elif kind == "engine_ready":
                    outcome.engine_seconds, outcome.model_runner = event["seconds"], event["model_runner"]
                    outcome.platform = event["platform"]
                elif kind == "repeat":
                    outcome.repeats.append(event)
                elif kind == "error":
                    outcome.error = event
                elif kind == "done":
                    finished = True
                on_event({"event": kind, **event})
        returncode = process.wait()
        if cancelled() and not finished:
            outcome.status = "interrupted"
    except KeyboardInterrupt:  # the caller records what finished, then stops
        os.killpg(process.pid, 9)
        process.wait()
        outcome.status = "ok" if finished else "interrupted"
        returncode = 0
    finally:
        _RUNNING.discard(process)
        Path(handle.name).unlink(missing_ok=True)
        outcome.seconds = round(time.monotonic() - started, 1)
        outcome.log_tail = list(tail)
    if outcome.status == "interrupted" or finished:  # every repeat was reported: a kill while exiting loses nothing
        return outcome
    if outcome.error is None and returncode != 0:
        outcome.error = {"phase": "engine" if outcome.engine_seconds is None else "generate",
                         "type": f"exit status {returncode}", "message": "the engine process died without "
                         "reporting an error (killed, out of memory, or a crash in native code)",
                         "traceback_tail": []}
    if outcome.error is not None:
        outcome.status = "unsupported" if is_refusal({**outcome.error, "log_tail": outcome.log_tail}) else "crashed"
    elif len(outcome.repeats) < request["repeats"] * len(request.get("prompts") or [None]):
        outcome.status = "crashed"
    return outcome


def is_refusal(error: dict) -> bool:
    """vLLM refused the configuration while setting up the engine, in one of its known refusal messages:
    the exception the caller saw, or, where that is only "Engine core initialization failed" (a GPU
    engine's core runs in its own process), the one the engine process raised (its log's last lines).
    Failing later (while generating), dying, running out of memory, or any other exception (a harness
    error looks the same from here) is a crash, not a refusal."""
    if error["phase"] != "engine" or error["type"] in OUT_OF_MEMORY or error["type"].startswith("exit status"):
        return False
    message = error.get("message") or ""
    if ENGINE_CORE_FAILED in message:
        cause = root_cause(error)
        if cause is None or cause.split(":")[0].rsplit(".", 1)[-1] in OUT_OF_MEMORY:
            return False
        message = cause
    return any(re.search(pattern, message, re.IGNORECASE) for pattern in REFUSALS)


ROOT_CAUSE = re.compile(r"^(?:\(EngineCore[^)]*\)\s*)?((?:\w+\.)*\w*(?:Error|Exception)): (.+)$")


def root_cause(error: dict) -> str | None:
    """The exception that the engine's own process raised, from the engine log's last lines ("Engine core
    initialization failed" is only what the caller saw), or None if the log names none."""
    causes = [f"{m[1]}: {m[2].strip()}" for m in map(ROOT_CAUSE.match, error.get("log_tail") or []) if m]
    causes = [c for c in causes if c != f"{error.get('type')}: {(error.get('message') or '').strip()}"]
    return causes[-1] if causes else None


# ---------------------------------------------------------------------------------------- results
def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first output token that differs (or where one sequence ends), None if identical."""
    for index, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def tokens_before_stop(repeat: dict) -> int | None:
    """Output tokens written before the stop, as the report counts them ("stops after the 10th output token").

    vLLM keeps the end-of-text (or stop-token) id as the last of a stopped request's `token_ids`, so
    `output_tokens` counts it; a stop string (`stop_reason` a str) ends on ordinary text tokens."""
    if repeat["finish_reason"] != "stop":
        return None
    return repeat["output_tokens"] - (0 if isinstance(repeat.get("stop_reason"), str) else 1)


def tokens_written(repeat: dict) -> int:
    """Output tokens a repeat wrote, the end-of-text token not counted (as the report counts: "stops after
    the 10th output token"); a repeat that ran to max_tokens wrote all of them."""
    before = tokens_before_stop(repeat)
    return repeat["output_tokens"] if before is None else before


def stopped_earlier(repeat: dict, baseline: dict) -> bool:
    """Whether a repeat stopped before its baseline did: it stopped where the baseline ran to the limit, or
    both stopped and it wrote fewer tokens (the end-of-text token not counted on either side)."""
    if repeat["finish_reason"] != "stop":
        return False
    return baseline["finish_reason"] != "stop" or tokens_written(repeat) < tokens_written(baseline)


def summarize(outcome: Outcome, config: EngineConfig, prompt_len: int, baseline: list[int] | None) -> dict:
    """The record's results: status, per-repeat outcomes, distinct outputs, the baseline comparison.

    Positions are 0-based in the whole sequence: the prompt fills 0 … prompt_len − 1, and a stop's
    `stop_position` is where its end-of-text token sits (prompt_len + tokens before the stop), as in the
    incident (1845 + 10 = 1855, chosen by the logits at 1854). The report's own `prompt_len + 8` counts
    differently and is not recomputed here (the incident chapter sets its three names side by side)."""
    repeats = []
    for r in outcome.repeats:
        divergence = first_divergence(r["token_ids"], baseline) if baseline is not None else None
        before = tokens_before_stop(r)
        repeats.append({
            "finish_reason": r["finish_reason"], "stop_reason": r["stop_reason"], "output_tokens": r["output_tokens"],
            "tokens_before_stop": before, "stop_position": None if before is None else prompt_len + before,
            "token_hash": r["token_hash"], "token_ids": r["token_ids"], "tail_tokens": r["tail_tokens"],
            "tail_text": r["tail_text"], "seconds": r["seconds"], "speculation": r.get("speculation") or {},
            "stop_margin": r.get("stop_margin"), "top2_margins": r.get("top2_margins"),
            "same_as_baseline": None if baseline is None else divergence is None,
            "first_divergence": divergence,
        })
    stopped = [r for r in repeats if r["finish_reason"] == "stop"]
    results = {
        "status": outcome.status,
        "expected": config.expect,
        "as_expected": outcome.status in EXPECTED_STATUSES[config.expect],
        "stopped_early": bool(stopped) if repeats else None,
        "runs_stopped": len(stopped),
        "runs_total": len(repeats),
        "finish_reason": repeats[0]["finish_reason"] if len({r["finish_reason"] for r in repeats}) == 1 else None,
        "output_tokens_before_stop": stopped[0]["tokens_before_stop"] if stopped else None,
        "stop_position": stopped[0]["stop_position"] if stopped else None,
        "tail_text": stopped[0]["tail_text"] if stopped else None,
        "identical_outputs": len({r["token_hash"] for r in repeats}) == 1 if repeats else None,
        "distinct_outputs": len({r["token_hash"] for r in repeats}),
        "prompt_tokens": prompt_len,
        "repeats": repeats,
        "vllm_version": outcome.vllm_version,
        "backend": outcome.platform,
        "model_runner_used": outcome.model_runner,
        "engine_start_seconds": outcome.engine_seconds,
        "seconds": outcome.seconds,
    }
    if outcome.error is not None:
        results["error"] = {**outcome.error, "log_tail": outcome.log_tail}
    return results


def record_id(matrix: Matrix, config: EngineConfig, environment: str, seed: int, model: str = "organism") -> str:
    """The record's id (and file name); a model other than the organism is named in it, so that runs of two
    models in one environment on one host never overwrite each other."""
    from spectie.fingerprint import host_id

    named = "" if model == "organism" else re.sub(r"[^a-z0-9.]+", "-", model.lower()).strip("-")[:60] + "-"
    return f"reproduce-{environment}-{named}{matrix.name}-{config.id}-s{seed}-{host_id()}".lower().replace("_", "-")


def make_record(config: EngineConfig, matrix: Matrix, request: dict, results: dict, environment: str,
                model_label: str, probe: dict, key: str, started_at: str, content_hash: str,
                seed: int, prompt_ids: list[int]) -> dict:
    from spectie.fingerprint import model_digest
    from spectie.records import measured_record

    kwargs = request["llm_kwargs"]
    parameters = {
        "method": config.method, "num_speculative_tokens": config.k, "model_runner": config.model_runner,
        "enforce_eager": config.enforce_eager, "cudagraph_mode": config.cudagraph_mode,
        "enable_prefix_caching": config.enable_prefix_caching, "max_tokens": config.max_tokens,
        "temperature": config.temperature, "prompt_tokens": len(prompt_ids), "prompt_seed": seed,
        "prompt_seeds": len(request["prompts"]), "expect": config.expect,
        "configuration": config.id, "matrix": matrix.name, "baseline": matrix.baseline, "model": model_label,
        "ignore_eos": config.ignore_eos,
        "repeats": config.repeats, "batch_invariant": config.batch_invariant, "llm_kwargs": kwargs,
        "environment_variables": request["environment"], "measurement_key": key,
        "prompt_token_ids": list(prompt_ids),
    }
    record = measured_record(
        record_id=record_id(matrix, config, environment, seed, model_label), kind="engine-outcome", chapter=CHAPTER,
        title=f"vLLM {probe['vllm_version']} ({probe['platform']}): {config.id}, prompt seed {seed}",
        environment=environment,
        parameters=parameters, results=results, started_at=started_at, content_hash=content_hash,
        dtype=str(kwargs.get("dtype")))
    if record["fingerprint"]["model_sha256"] is None:  # the label is not a path (a random-weight checkpoint's)
        record["fingerprint"]["model_sha256"] = model_digest(kwargs["model"])
    engine_fingerprint(record, probe)
    return record


def engine_fingerprint(record: dict, probe: dict) -> None:
    """The engine ran in the target interpreter: its library versions are the ones that count."""
    for name in ("torch", "transformers", "cuda", "python"):
        record["fingerprint"][name] = probe[name]
    record["fingerprint"]["vllm"] = probe["vllm_version"]
    record["fingerprint"]["vllm_platform"] = probe["platform"]


def remaining_estimate(finished: list[tuple[Outcome, int]], left: list[EngineConfig], parallel: int,
                       prompts: int = 1) -> float:
    """Seconds still to go: measured engine overhead and seconds per repeat, applied to what is left
    (`prompts`: generations per repeat)."""
    repeats = sum(len(o.repeats) for o, _ in finished)
    repeat_seconds = sum(r["seconds"] for o, _ in finished for r in o.repeats)
    overhead = (sum(o.seconds for o, _ in finished) - repeat_seconds) / len(finished)
    per_repeat = repeat_seconds / repeats if repeats else 0.0
    return sum(overhead + c.repeats * prompts * per_repeat for c in left) / max(1, min(parallel, len(left)))


def start_order(configs: list[EngineConfig], baseline: str | None) -> list[int]:
    """Indexes of `configs` in the order their engines start: the baseline first (every comparison
    needs it), then the most repeats first, so that the longest configuration does not start last and
    leave the other engine slots idle; otherwise matrix order."""
    return sorted(range(len(configs)), key=lambda i: (configs[i].id != baseline, -configs[i].repeats))


class BaselineFailed(UsageError):
    """The baseline configuration did not finish: no other configuration can be compared with it."""


def run_matrix(matrix: Matrix, model: str, prompts: dict[int, list[int]], environment: str, probe: dict,
               content_hash: str, extra_engine: dict | None = None, model_label: str | None = None,
               resume: bool = True, progress: bool = True, results_dir: Path | None = None,
               log=print) -> list[dict]:
    """Run every configuration on every prompt (`prompts`: prompt seed -> token ids), `matrix.parallel`
    engines at a time, the baseline first; write and return one record per configuration and prompt
    seed, in matrix order. Raises BaselineFailed (after recording it) if the baseline does not finish."""
    import queue
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    from spectie.fingerprint import host_id, now
    from spectie.records import measured_path, recorded_measurement, write_record

    if not prompts:
        raise UsageError("the matrix needs at least one prompt")
    seeds = list(prompts)
    python = engine_python(environment)
    logs = project_root() / "_build" / "logs" / CHAPTER
    configs = list(matrix.configs)
    overall = tqdm(total=sum(c.repeats for c in configs) * len(seeds), desc="matrix", unit="run",
                   disable=not progress, file=sys.stderr, position=0)
    lock = threading.Lock()
    baseline_done = threading.Event()
    baseline_tokens: dict[int, list[int]] = {}  # prompt seed -> the baseline's first repeat
    finished: list[tuple[Outcome, int]] = []
    started_configs: list[str] = []
    interrupted = threading.Event()
    slots: queue.Queue = queue.Queue()
    for slot in range(matrix.parallel):
        slots.put(slot)

    def path_of(config: EngineConfig, seed: int) -> Path:
        rid = record_id(matrix, config, environment, seed, model_label or model)
        return measured_path({"environments": [environment], "chapter": CHAPTER, "id": rid,
                              "fingerprint": {"host_id": host_id()}}, results_dir)

    def set_baseline(records: list[dict]) -> None:
        for record in records:
            repeats = record["results"]["repeats"]
            if record["results"]["status"] == "ok" and repeats:
                baseline_tokens[record["parameters"]["prompt_seed"]] = repeats[0]["token_ids"]
        missing = [r for r in records if r["parameters"]["prompt_seed"] not in baseline_tokens]
        if missing:
            interrupted.set()  # no configuration starts or is recorded without its comparison
        baseline_done.set()
        if missing:
            results = missing[0]["results"]
            error = results.get("error") or {}
            reason = f"{error.get('type')}: {error.get('message', '')[-300:]}" if error else "no repeat finished"
            raise BaselineFailed(
                f"the baseline {matrix.baseline!r} did not finish ({results['status']}, prompt seed "
                f"{missing[0]['parameters']['prompt_seed']}): {reason}. Without it no configuration can be "
                f"compared, so the matrix stops here; its record: {path_of(matrix.configs[0], missing[0]['parameters']['prompt_seed'])}")

    def run_one(number: int, config: EngineConfig) -> list[dict]:
        request = request_for(config, matrix, model, list(prompts.values()), extra_engine)
        key = request_key(request, probe["vllm_version"])
        paths = {seed: path_of(config, seed) for seed in seeds}
        is_baseline = config.id == matrix.baseline
        done = [recorded_measurement(paths[seed], key) for seed in seeds] if resume else [None]
        if all(r is not None for r in done):
            log(f"[{number}/{len(configs)}] {config.id}: recorded earlier ({done[0]['results']['status']}), skipped")
            overall.update(config.repeats * len(seeds))
            if is_baseline:
                set_baseline(done)
            return done
        if interrupted.is_set():
            raise KeyboardInterrupt
        with lock:
            started_configs.append(config.id)
            left = [c for c in configs if c.id not in started_configs]
            eta = remaining_estimate(finished, [config] + left, matrix.parallel, len(seeds)) if finished else None
            eta = f", about {eta / 60:.1f} min left" if eta is not None else ""
        log(f"[{number}/{len(configs)}] {config.id}: starting an engine{eta}")
        bar = tqdm(total=config.repeats * len(seeds), desc=config.id, unit="run", leave=False,
                   disable=not progress, file=sys.stderr, position=1 + (number - 1) % matrix.parallel)

        def on_event(event):
            if event["event"] == "repeat":
                bar.update(1)
                overall.update(1)
            elif event["event"] == "engine_ready":
                bar.set_postfix_str(f"engine ready in {event['seconds']:.0f} s")

        started_at = now()
        slot = slots.get()
        placement = slot_environment(slot, matrix.parallel, probe["platform"])
        try:
            outcome = run_child(python, request, logs / f"{paths[seeds[0]].stem}.log", on_event,
                                interrupted.is_set, placement)
        finally:
            slots.put(slot)
            bar.close()
        overall.update(config.repeats * len(seeds) - len(outcome.repeats))
        if not is_baseline and matrix.baseline:
            baseline_done.wait()  # the comparison needs the baseline's tokens
            if interrupted.is_set() and not baseline_tokens:
                raise KeyboardInterrupt(f"{config.id}: not recorded, the baseline failed")
        records = []
        for number_in_request, seed in enumerate(seeds):
            own = replace(outcome, repeats=[r for r in outcome.repeats if r.get("prompt", 0) == number_in_request])
            results = summarize(own, config, len(prompts[seed]), None if is_baseline else baseline_tokens.get(seed))
            results["placement"] = placement  # extra environment of this engine (its CPU core), if any
            record = make_record(config, matrix, request, results, environment, model_label or model, probe, key,
                                 started_at, content_hash, seed, prompts[seed])
            write_record(record, paths[seed])
            records.append(record)
        with lock:
            finished.append((outcome, config.repeats * len(seeds)))
        if outcome.status == "interrupted":
            interrupted.set()
            raise KeyboardInterrupt(f"interrupted during {config.id}; its finished repeats are in {paths[seeds[0]]}")
        if is_baseline:
            set_baseline(records)
        stopped = sum(r["results"]["runs_stopped"] for r in records)
        log(f"    {config.id}: {outcome.status}{'' if records[0]['results']['as_expected'] else ' (not as expected)'}"
            f", {stopped}/{len(outcome.repeats)} stopped, {outcome.seconds:.0f} s")
        return records

    if matrix.baseline is None:
        baseline_done.set()
    try:
        with ThreadPoolExecutor(max_workers=matrix.parallel) as pool:
            futures = {i: pool.submit(run_one, i + 1, configs[i]) for i in start_order(configs, matrix.baseline)}
            try:
                return [record for i in range(len(configs)) for record in futures[i].result()]
            except BaseException:
                interrupted.set()
                baseline_done.set()
                for f in futures.values():
                    f.cancel()
                kill_running()  # running engines stop; their finished repeats are recorded
                raise
    finally:
        overall.close()
