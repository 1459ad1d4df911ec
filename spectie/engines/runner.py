"""One engine of a reproduction run, and the record it makes: what defines and derives a measurement (its key
hashes this file, with spectie/engines/child.py, spectie/tools/tiestop.py and spectie/records/completions.py).

`request_for` builds what the engine child (spectie.engines.child) runs; `run_child` runs it in its own process
and reads its events into an `Outcome`. A configuration that vLLM refuses with one of its known refusal messages
becomes `status: unsupported`; any other failure (a crash, an out-of-memory, a harness error) becomes `crashed`,
with the traceback's last lines. `summarize` turns an outcome into a record's results (compared with the
baseline's tokens), `make_record` into the record. The checks before any engine are in spectie.engines.checks;
the matrix run (slots, resume, progress, the baseline first) in spectie.engines.matrix_run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from spectie.records.completions import first_divergence, tokens_before_stop
from spectie.engines.child import MARKER
from spectie.engines.matrix import EXPECTED_STATUSES, EngineConfig, Matrix
from spectie.records.paths import project_root

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


def child_environment(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    root = str(project_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


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
    done: bool = False  # the child reported `done`: every repeat of every prompt


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
RUN_SOURCES = ("spectie/engines/runner.py", "spectie/engines/child.py", "spectie/tools/tiestop.py",
               "spectie/records/completions.py")


def request_key(request: dict, vllm_version: str) -> str:
    """Identity of a run: the same weights (by digest, wherever they lie), engine arguments, prompts, sampling,
    repeats, vLLM and code (`fingerprint.measurement_key`); a record holding it is reused, not run again."""
    from spectie.records.fingerprint import measurement_key

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


def run_child(python: Path, request: dict, log_path: Path, on_event=lambda event: None,
              cancelled=lambda: False, extra_environment: dict | None = None) -> Outcome:
    """Run one configuration in a child process; every event is passed to `on_event` as it arrives.

    Ctrl-C (here, or `cancelled()` turning true after kill_running()) kills the engine and returns
    what finished, with status `interrupted`.
    """
    outcome, tail = Outcome(), deque(maxlen=TAIL_LINES)
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
        read_events(process, outcome, tail, log_path, on_event)
        returncode = process.wait()
        if cancelled() and not outcome.done:
            outcome.status = "interrupted"
    except KeyboardInterrupt:  # the caller records what finished, then stops
        os.killpg(process.pid, 9)
        process.wait()
        outcome.status = "ok" if outcome.done else "interrupted"
        returncode = 0
    finally:
        _RUNNING.discard(process)
        Path(handle.name).unlink(missing_ok=True)
        outcome.seconds = round(time.monotonic() - started, 1)
        outcome.log_tail = list(tail)
    if outcome.status != "interrupted" and not outcome.done:  # all reported: a kill while exiting loses nothing
        judge_failure(outcome, request, returncode)
    return outcome


def read_events(process, outcome: Outcome, tail: deque, log_path: Path, on_event) -> None:
    """The child's output until it ends: vLLM's log lines to `log_path` (the last ones kept in `tail`), its events
    into `outcome` (`done` when it reported every repeat) and to `on_event`."""
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
                outcome.done = True
            on_event({"event": kind, **event})


def judge_failure(outcome: Outcome, request: dict, returncode: int) -> None:
    """The status of a child that did not report `done`: `unsupported` for a known refusal while setting up the
    engine, else `crashed` (an error, a death without one, or repeats missing)."""
    if outcome.error is None and returncode != 0:
        outcome.error = {"phase": "engine" if outcome.engine_seconds is None else "generate",
                         "type": f"exit status {returncode}", "message": "the engine process died without "
                         "reporting an error (killed, out of memory, or a crash in native code)",
                         "traceback_tail": []}
    if outcome.error is not None:
        outcome.status = "unsupported" if is_refusal({**outcome.error, "log_tail": outcome.log_tail}) else "crashed"
    elif len(outcome.repeats) < request["repeats"] * len(request.get("prompts") or [None]):
        outcome.status = "crashed"


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


def record_id(matrix: Matrix, config: EngineConfig, environment: str, seed: int, model: str = "organism",
              seeds: list[int] | None = None, tensor_parallel_size: int = 1) -> str:
    """The record's id (and file name). A model other than the organism, a tensor-parallel size above 1 and a set of
    prompt seeds other than this one alone are named in it, so that runs that differ in them never overwrite
    each other (seeds 0 to 7: `-of-0-7`; a set that is not a range: a digest of it)."""
    from spectie.records.fingerprint import host_id

    named = "" if model == "organism" else re.sub(r"[^a-z0-9.]+", "-", model.lower()).strip("-")[:60] + "-"
    split = "" if tensor_parallel_size == 1 else f"-tp{tensor_parallel_size}"
    return (f"reproduce-{environment}-{named}{matrix.name}-{config.id}{split}-s{seed}{seed_set(seed, seeds)}-"
            f"{host_id()}").lower().replace("_", "-")


def seed_set(seed: int, seeds: list[int] | None) -> str:
    """How a record id names the prompt seeds its run took ('' for this seed alone)."""
    if not seeds or list(seeds) == [seed]:
        return ""
    if list(seeds) == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"-of-{seeds[0]}-{seeds[-1]}"
    return "-of-" + hashlib.sha256(json.dumps(list(seeds)).encode()).hexdigest()[:8]


def make_record(config: EngineConfig, matrix: Matrix, request: dict, results: dict, environment: str,
                model_label: str, probe: dict, key: str, started_at: str, content_hash: str,
                seed: int, prompt_ids: list[int], seeds: list[int] | None = None) -> dict:
    from spectie.records.fingerprint import model_digest
    from spectie.records.store import measured_record

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
        "prompt_token_ids": list(prompt_ids), "tensor_parallel_size": kwargs.get("tensor_parallel_size", 1),
    }
    rid = record_id(matrix, config, environment, seed, model_label, seeds, parameters["tensor_parallel_size"])
    record = measured_record(
        record_id=rid, kind="engine-outcome", chapter=CHAPTER,
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


