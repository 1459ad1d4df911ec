"""The guard measured on a real server: the tie-stop survey's prompts through `vllm serve` with MTP speculation
(the incident's setting), each sent straight to the server and through the guard (`spectie.tools.guard.complete`,
in this process: the proxy's own HTTP hop is not in the figures), one request at a time, alternating.

What it records per prompt: whether a near-tie end-of-text stop reached the client (the detector's rule at the
guard's threshold, on the response the client got), how many stops the guard resumed and with how many extra
requests, and each request's wall-clock time; `summary` turns that into the guidance chapter's figures.
"""

from __future__ import annotations

import sys
import time

from spectie.records.errors import UsageError
from spectie.records.record_types import Record

CHAPTER = "guidance"
KIND = "guard-survey"
SPECULATIVE = {"method": "mtp", "num_speculative_tokens": 1}
# The files whose code computes the measurement (with the weights, arguments and library versions: its key).
GUARD_SOURCES = ("spectie/tools/guard.py", "spectie/engines/guard_measure.py", "spectie/engines/serve.py",
                 "spectie/lab/prompts.py", "spectie/tools/tiestop.py", "spectie/tools/thresholds.py")


def check_arguments(prompts, max_tokens) -> None:
    for name, value in (("guard_prompts", prompts), ("guard_tokens", max_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"{name} must be an integer >= 1, got {value!r}")


def _timed(call, *args) -> tuple[dict, float]:
    started = time.perf_counter()
    response = call(*args)
    return response, round(time.perf_counter() - started, 4)


def _outcome(checked, response: dict, seconds: float) -> dict:
    """What the client got: how it ended, its stop's margin, and whether it ended on a near-tie end-of-text stop (the
    guard's own rule, `guard.near_tie_verdict`)."""
    from spectie.tools.guard import near_tie_verdict, part_of
    from spectie.tools.tiestop import check, from_openai

    [completion] = from_openai(response)
    verdict = check(completion, checked.threshold, checked.stops)
    near_tie = near_tie_verdict(checked, part_of(response)) is not None
    report = response.get("guard") or {}
    return {"finish_reason": completion.finish_reason, "output_tokens": response["usage"]["completion_tokens"],
            "near_tie_stop": near_tie, "stop_margin": verdict.margin, "seconds": seconds,
            "resumed": len(report.get("resumed", [])), "extra_requests": report.get("extra_requests", 0)}


def measure_prompts(checked, prompts: list[list[int]], max_tokens: int, bar=None) -> list[dict]:
    """Each prompt straight to the server and through the guard (greedy, top-2 logprobs in both), one request at a
    time; `bar` (tqdm) counts the prompts done."""
    from spectie.tools.guard import COMPLETIONS, complete, send

    rows = []
    for ids in prompts:
        body = {"model": checked.served_model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                "logprobs": 2}
        direct, direct_seconds = _timed(send, checked, COMPLETIONS, body)
        guarded, guarded_seconds = _timed(complete, checked, COMPLETIONS, body)
        rows.append({"direct": _outcome(checked, direct, direct_seconds),
                     "guarded": _outcome(checked, guarded, guarded_seconds)})
        if bar is not None:
            bar.update(1)
    return rows


def measure_on_servers(python, model: str, prompts: list[list[int]], max_tokens: int, servers: int, platform: str,
                       progress: bool = True) -> tuple[list[dict], float, str, int]:
    """The prompts shared out over `servers` identical `vllm serve` processes (prompt i to server i % servers), each
    on cores of its own (`matrix_run.slot_environment`) and serving one request at a time, so every request runs
    alone in its engine, as with one server, in a fraction of the time. Each prompt's two requests (straight and
    guarded) go to the same server. Returns the rows in prompt order, the guard's threshold, where it came from and
    its resume limit."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    from spectie.tools import guard
    from spectie.engines.matrix_run import slot_environment
    from spectie.engines.serve import free_port, serve_command, served
    from spectie.records.paths import project_root

    logs = project_root() / "_build" / "logs" / CHAPTER
    bar = tqdm(total=len(prompts), desc="guard survey", unit="prompt", disable=not progress, file=sys.stderr)

    def serve(slot: int):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = logs / (f"guard-survey-serve-{slot}.log" if servers > 1 else "guard-survey-serve.log")
        with served(serve_command(python, model, port, SPECULATIVE), url, log,
                    environment=slot_environment(slot, servers, platform)):
            checked = guard.open_guard(url, model)
            return checked, measure_prompts(checked, prompts[slot::servers], max_tokens, bar)

    try:
        with ThreadPoolExecutor(max_workers=servers) as pool:
            done = list(pool.map(serve, range(servers)))
    finally:
        bar.close()
    rows = [None] * len(prompts)
    for slot, (_, part) in enumerate(done):
        rows[slot::servers] = part
    checked = done[0][0]
    return rows, checked.threshold, checked.threshold_origin, checked.max_resumes


def record_path(environment: str, results_dir=None):
    """Where this host's guard survey in `environment` lives (one per environment and host)."""
    from spectie.records.fingerprint import host_id
    from spectie.records.store import measured_path

    return measured_path({"environments": [environment], "fingerprint": {"host_id": host_id()}, "chapter": CHAPTER,
                          "id": f"{KIND}-{environment}-{host_id()}".lower()}, results_dir)


def measure(model: str, environment: str, count: int = 24, max_tokens: int = 200, content_hash: str | None = None,
            model_label: str | None = None, progress: bool = True, results_dir=None, log=print) -> Record:
    """The survey's first `count` prompts through `vllm serve` (MTP, one speculative token) without and with the
    guard; this host's record, reused where the same measurement is recorded, else made, written and returned."""
    from spectie.engines.checks import engine_python, probe_vllm
    from spectie.engines.matrix import default_matrix_name, read_matrix
    from spectie.engines.runner import engine_fingerprint
    from spectie.records.fingerprint import host_id, measurement_key, now
    from spectie.lab.prompts import build_prompt
    from spectie.records.store import measured_record, read_record, recorded_measurement, write_record
    from spectie.lab.prompts import LENGTHS, prompt_specs
    from spectie.lab.tokenizer import model_tokenizer

    check_arguments(count, max_tokens)
    specs = prompt_specs(count)
    key = measurement_key(KIND, model, {"prompts": count, "max_tokens": max_tokens, "speculative": SPECULATIVE,
                                        "model_label": model_label, "environment": environment}, GUARD_SOURCES)
    earlier = recorded_measurement(record_path(environment, results_dir), key)
    if earlier is not None:
        log(f"guard survey: recorded earlier with the same weights, prompts, server and code "
            f"({earlier.finished_at}), reused")
        return earlier
    python = engine_python(environment)
    probe = probe_vllm(environment, python)
    tokenizer = model_tokenizer(model)
    prompts = [list(build_prompt(spec, tokenizer).token_ids) for spec in specs]
    servers = min(count, read_matrix(default_matrix_name(environment)).parallel)
    started_at = now()
    log(f"guard survey: {servers} vllm serve process{'es' if servers > 1 else ''} (MTP, one speculative token), "
        f"{count} prompts without and with the guard")
    rows, threshold, origin, max_resumes = measure_on_servers(python, model, prompts, max_tokens, servers,
                                                             probe["platform"], progress)
    for spec, ids, row in zip(specs, prompts, rows):
        row.update(tokens=spec.tokens, seed=spec.seed, template=spec.template, prompt_tokens=len(ids))
    parameters = {"model": model_label or model, "prompts": count, "prompt_lengths": list(LENGTHS),
                  "max_tokens": max_tokens, "speculative_config": SPECULATIVE, "measurement_key": key,
                  "server": "vllm serve (OpenAI-compatible /v1/completions), greedy, one request at a time",
                  "servers": servers}
    record = measured_record(
        record_id=f"{KIND}-{environment}-{host_id()}".lower(), kind=KIND, chapter=CHAPTER,
        title=f"The guard on {count} ordinary prompts through vllm serve {probe['vllm_version']} ({probe['platform']})",
        environment=environment, parameters=parameters,
        results={"vllm_version": probe["vllm_version"], "backend": probe["platform"], "threshold": threshold,
                 "threshold_origin": origin, "max_resumes": max_resumes, "prompts": rows},
        started_at=started_at, content_hash=content_hash, dtype="bfloat16")
    engine_fingerprint(record, probe)
    return read_record(write_record(record, record_path(environment, results_dir)))

