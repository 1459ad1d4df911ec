"""The guard under load: `vllm serve` (plain greedy, MTP K=1, MTP K=8; prefix caching on and off) sent batches of
concurrent requests (1, 8 and 64 in flight), each batch once straight to the server and once through the real proxy
(`spectie guard serve`, a process of its own in front of the server).

Two workloads per level:
- `distinct`: the incident's matrix prompts (1845-token listings, seeds 0-7) and the survey's ordinary prompts, as many
  requests as the level or the prompts, whichever is more, `level` in flight at a time;
- `copies`: `level` copies of one matrix prompt sent at once (a batch of identical requests), per chosen seed.

Every request is recorded (how it ended, a digest of its tokens, its stop's margin, the guard's resumes and extra
requests, its seconds, any error), and every batch (its wall time and tokens). One record per environment, host,
server and prefix-caching setting; what load changed is computed from the records (`spectie.book.guard_load_page`).
Requests go to 127.0.0.1 only, bounded in count (the plan: `batches`) and time (BATCH_SECONDS a batch).
"""

from __future__ import annotations

import hashlib
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from spectie.records.errors import UsageError
from spectie.records.record_types import Record

CHAPTER = "guidance"
KIND = "guard-load"
SERVERS = {"plain": None,
           "mtp-k1": {"method": "mtp", "num_speculative_tokens": 1},
           "mtp-k8": {"method": "mtp", "num_speculative_tokens": 8}}
LEVELS = (1, 8, 64)
ROUTES = ("straight", "guarded")
BATCH_SECONDS = 600  # a batch still running after this is cut off: its unanswered requests are recorded as such
SOURCES = ("spectie/tools/guard.py", "spectie/tools/guard_proxy.py", "spectie/engines/guard_measure.py",
           "spectie/engines/guard_load.py", "spectie/engines/serve.py", "spectie/lab/prompts.py",
           "spectie/tools/tiestop.py", "spectie/tools/thresholds.py")


@dataclass(frozen=True)
class Item:
    """One prompt of a workload: its label (`seed-3`, `survey-7`), token ids and new tokens."""
    label: str
    ids: list[int]
    max_tokens: int


def _whole(name: str, value, least: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise UsageError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


def check_arguments(servers, levels, seeds, survey_prompts, survey_tokens, copies_seeds,
                    prefix_caching) -> None:
    """Every parameter of the load measurement, checked before any server starts."""
    for name, values, allowed in (("load_servers", servers, SERVERS), ("load_prefix_caching", prefix_caching,
                                                                       (True, False))):
        if not isinstance(values, list) or any(v not in allowed for v in values) or len(set(values)) < len(values):
            raise UsageError(f"{name} must be a list of distinct values from {list(allowed)}, got {values!r}")
    if not isinstance(levels, list) or not levels or any(_whole("load_levels", v, 1) > 256 for v in levels):
        raise UsageError(f"load_levels must be a non-empty list of concurrency levels from 1 to 256, got {levels!r}")
    if 1 not in levels:
        raise UsageError("load_levels must include 1: the one-at-a-time run every other level is compared with")
    for name, values in (("load_seeds", seeds), ("load_copies_seeds", copies_seeds)):
        if not isinstance(values, list) or any(_whole(name, v) > 10**6 for v in values):
            raise UsageError(f"{name} must be a list of prompt seeds, got {values!r}")
    if not set(copies_seeds) <= set(seeds):
        raise UsageError(f"load_copies_seeds {copies_seeds} must be among load_seeds {seeds}: a copy's one-at-a-time "
                         "output is the reference")
    _whole("load_survey_prompts", survey_prompts)
    _whole("load_survey_tokens", survey_tokens, 1)
    if not seeds and not survey_prompts:
        raise UsageError("the load measurement needs prompts: give load_seeds or load_survey_prompts")


def workload(model: str, seeds: list[int], matrix_tokens: int, survey_prompts: int, survey_tokens: int) -> list[Item]:
    """The matrix prompts of `seeds` (`matrix_tokens` new tokens) and the first `survey_prompts` survey prompts."""
    from spectie.lab.prompts import PromptSpec, build_prompt
    from spectie.lab.prompts import prompt_specs
    from spectie.lab.tokenizer import model_tokenizer

    tokenizer = model_tokenizer(model)
    items = [Item(f"seed-{s}", list(build_prompt(PromptSpec(1845, s, "raw"), tokenizer).token_ids), matrix_tokens)
             for s in seeds]
    specs = prompt_specs(survey_prompts) if survey_prompts else []
    return items + [Item(f"survey-{s.seed}", list(build_prompt(s, tokenizer).token_ids), survey_tokens) for s in specs]


def batches(items: list[Item], levels: list[int], copies_seeds: list[int]) -> list[tuple[int, str, list[Item]]]:
    """(level, workload, requests) in the order they are sent: at each level the distinct prompts (cycled up to the
    level), then `level` copies of each chosen seed's prompt (above level 1: at level 1 a copy is the prompt alone)."""
    by_label = {item.label: item for item in items}
    planned = []
    for level in sorted(levels):
        count = max(level, len(items))
        planned.append((level, "distinct", [items[i % len(items)] for i in range(count)]))
        if level > 1:
            planned += [(level, "copies", [by_label[f"seed-{s}"]] * level) for s in copies_seeds]
    return planned


def digest(token_ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


def request_row(checked, item: Item, response: dict | None, seconds: float, error: str | None) -> dict:
    """One request as the client saw it: how it ended, its tokens' digest, whether it ended on a near-tie stop, the
    guard's resumes (through the proxy), its seconds, or the error it got."""
    from spectie.engines.guard_measure import _outcome

    row = {"prompt": item.label, "seconds": round(seconds, 4), "error": error}
    if response is None:
        return row
    choice = response["choices"][0]
    ids = choice.get("token_ids") or []
    row.update(_outcome(checked, response, round(seconds, 4)))
    row.update(digest=digest(ids), token_ids=ids)
    return row


def send_batch(checked, url: str, requests: list[Item], level: int, seconds: float = BATCH_SECONDS) -> tuple[list[dict], float]:
    """`requests` to `url`/v1/completions, `level` in flight at a time (greedy, top-2 logprobs, token ids); the rows
    in request order and the batch's wall time. A request still unanswered after `seconds` is recorded as cut off."""
    import httpx

    def one(item: Item) -> dict:
        body = {"model": checked.served_model, "prompt": item.ids, "max_tokens": item.max_tokens, "temperature": 0,
                "logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True}
        started = time.perf_counter()
        try:
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=seconds)
            if reply.status_code != 200:
                error = f"HTTP {reply.status_code}: {' '.join(reply.text.split())[:300]}"
                return request_row(checked, item, None, time.perf_counter() - started, error)
            return request_row(checked, item, reply.json(), time.perf_counter() - started, None)
        except (httpx.HTTPError, ValueError, KeyError, UsageError) as exc:
            return request_row(checked, item, None, time.perf_counter() - started, f"{type(exc).__name__}: {exc}")

    started = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=level)
    futures = [pool.submit(one, item) for item in requests]
    wait(futures, timeout=seconds + 30)
    pool.shutdown(wait=False, cancel_futures=True)
    wall = time.perf_counter() - started
    rows = [f.result() if f.done() and not f.cancelled() else
            {"prompt": item.label, "seconds": None, "error": f"cut off: not answered within {seconds} s"}
            for f, item in zip(futures, requests)]
    return rows, round(wall, 4)


def batch_summary(level: int, name: str, route: str, rows: list[dict], wall: float) -> dict:
    tokens = sum(r.get("output_tokens") or 0 for r in rows)
    return {"level": level, "workload": name, "route": route, "requests": len(rows), "wall_seconds": wall,
            "completion_tokens": tokens, "tokens_per_second": round(tokens / wall, 2) if wall else None,
            "errors": sum(1 for r in rows if r["error"])}


def keep_ids(rows: list[dict], level: int) -> list[dict]:
    """Token ids are kept at level 1 (the reference); above it, their digest says whether they are the same."""
    return rows if level == 1 else [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]


def run_server(checked, urls: dict[str, str], plan: list[tuple[int, str, list[Item]]], bar=None) -> tuple[list, list]:
    """Every planned batch, straight then through the guard: the request rows and the batch summaries."""
    rows, summaries = [], []
    for level, name, requests in plan:
        for route in ROUTES:
            got, wall = send_batch(checked, urls[route], requests, level)
            rows += [{"level": level, "workload": name, "route": route, **r} for r in keep_ids(got, level)]
            summaries.append(batch_summary(level, name, route, got, wall))
            if bar is not None:
                bar.update(len(requests))
    return rows, summaries


def record_path(environment: str, server: str, prefix_caching: bool, results_dir=None) -> Path:
    """Where this host's load record of one server lives (one per environment, host, server and prefix caching)."""
    from spectie.records.fingerprint import host_id
    from spectie.records.store import measured_path

    return measured_path({"environments": [environment], "fingerprint": {"host_id": host_id()}, "chapter": CHAPTER,
                          "id": record_id(environment, server, prefix_caching)}, results_dir)


def record_id(environment: str, server: str, prefix_caching: bool) -> str:
    from spectie.records.fingerprint import host_id

    cache = "prefix-cache" if prefix_caching else "no-prefix-cache"
    return f"{KIND}-{environment}-{server}-{cache}-{host_id()}".lower()


def guard_command(python, upstream: str, model: str, port: int) -> list[str]:
    """The proxy in front of `upstream`, as an operator runs it (`spectie guard serve`)."""
    return [str(python), "-m", "spectie", "guard", "serve", "--upstream", upstream, "--model", model,
            "--port", str(port), "--host", "127.0.0.1"]


def measure_server(setup: dict, server: str, prefix_caching: bool, plan, bar=None) -> dict:
    """One server (and the guard in front of it) through every planned batch: the record's results. A server or
    proxy that does not start is a result too (its error, and no rows)."""
    from spectie.tools import guard
    from spectie.engines.serve import error_line, free_port, serve_command, served
    from spectie.records.paths import project_root

    logs = project_root() / "_build" / "logs" / CHAPTER
    name = f"guard-load-{server}-{'prefix-cache' if prefix_caching else 'no-prefix-cache'}"
    ports = {route: free_port() for route in ROUTES}
    urls = {route: f"http://127.0.0.1:{port}" for route, port in ports.items()}
    model, python = setup["model"], setup["python"]
    command = serve_command(python, model, ports["straight"], SERVERS[server], prefix_caching, setup["engine"])
    results = {"server_command": " ".join(command[1:]), "error": None, "rows": [], "batches": []}
    try:
        with served(command, urls["straight"], logs / f"{name}.log", environment=setup["environment"]):
            with served(guard_command(python, urls["straight"], model, ports["guarded"]), urls["guarded"],
                        logs / f"{name}-guard.log", seconds=120,
                        environment={"PYTHONPATH": str(project_root())}):
                checked = guard.open_guard(urls["straight"], model)
                results["rows"], results["batches"] = run_server(checked, urls, plan, bar)
                results.update(threshold=checked.threshold, threshold_origin=checked.threshold_origin,
                               max_resumes=checked.max_resumes)
    except (RuntimeError, UsageError) as exc:
        server_log = logs / f"{name}.log"
        said = error_line(server_log.read_text(errors="replace")) if server_log.is_file() else None
        text = " ".join(str(exc).split()).replace(f"{project_root()}/", "")  # the logs' paths relative to the project
        results["error"] = (f"vllm serve: {said}; " if said else "") + text[-1200:]
    return results


def measure(model: str, environment: str, servers: list[str], prefix_caching: list[bool], levels: list[int],
            seeds: list[int], survey_prompts: int, survey_tokens: int, copies_seeds: list[int],
            content_hash: str | None = None, model_label: str | None = None, progress: bool = True,
            results_dir=None, log=print) -> list[Record]:
    """Every (server, prefix caching) pair through the planned batches: this host's records, each reused where the
    same measurement is recorded, else made, written and returned."""
    from tqdm import tqdm

    from spectie.engines.checks import engine_python, probe_vllm
    from spectie.engines.matrix import default_matrix_name, read_matrix
    from spectie.records.environments import get_environment

    check_arguments(servers, levels, seeds, survey_prompts, survey_tokens, copies_seeds, prefix_caching)
    env = get_environment(environment)
    matrix_tokens = read_matrix(default_matrix_name(environment)).configs[0].max_tokens
    items = workload(model, seeds, matrix_tokens, survey_prompts, survey_tokens)
    plan = batches(items, levels, copies_seeds)
    python = engine_python(environment)
    probe = probe_vllm(environment, python)
    setup = {"model": model, "python": python, "engine": env.get("engine") or {},
             "environment": {**(env.get("engine_environment") or {})}, "probe": probe, "label": model_label or model,
             "environment_id": environment, "content_hash": content_hash}
    arguments = {"levels": sorted(levels), "prompts": [[i.label, len(i.ids), i.max_tokens] for i in items],
                 "copies_seeds": copies_seeds, "engine": setup["engine"], "model_label": model_label}
    pairs = [(s, p) for p in prefix_caching for s in servers]  # in the order given: the first setting for every server
    bar = tqdm(total=len(pairs) * len(ROUTES) * sum(len(r) for _, _, r in plan), desc="guard under load",
               unit="request", disable=not progress, file=sys.stderr)
    try:
        return [one_record(setup, server, cache, plan, arguments, bar, results_dir, log) for server, cache in pairs]
    finally:
        bar.close()


def one_record(setup: dict, server: str, prefix_caching: bool, plan, arguments: dict, bar, results_dir, log) -> Record:
    from spectie.engines.runner import engine_fingerprint
    from spectie.records.fingerprint import measurement_key, now
    from spectie.records.store import measured_record, read_record, recorded_measurement, write_record

    environment, model = setup["environment_id"], setup["model"]
    key = measurement_key(KIND, model, {**arguments, "server": server, "speculative": SERVERS[server],
                                        "prefix_caching": prefix_caching, "environment": environment}, SOURCES)
    path = record_path(environment, server, prefix_caching, results_dir)
    earlier = recorded_measurement(path, key)
    cache = "prefix caching on" if prefix_caching else "prefix caching off"
    if earlier is not None:
        log(f"guard under load, {server}, {cache}: recorded earlier ({earlier.finished_at}), reused")
        bar.update(len(ROUTES) * sum(len(r) for _, _, r in plan))
        return earlier
    started_at = now()
    results = measure_server(setup, server, prefix_caching, plan, bar)
    probe = setup["probe"]
    parameters = {"model": setup["label"], "server": server, "speculative_config": SERVERS[server],
                  "prefix_caching": prefix_caching, "levels": arguments["levels"], "prompts": arguments["prompts"],
                  "copies_seeds": arguments["copies_seeds"], "routes": list(ROUTES), "batch_seconds": BATCH_SECONDS,
                  "measurement_key": key}
    record = measured_record(
        record_id=record_id(environment, server, prefix_caching), kind=KIND, chapter=CHAPTER,
        title=f"The guard under load: vllm serve {probe['vllm_version']} ({probe['platform']}), {server}, {cache}",
        environment=environment, parameters=parameters,
        results={"vllm_version": probe["vllm_version"], "backend": probe["platform"], **results},
        started_at=started_at, content_hash=setup["content_hash"], dtype="bfloat16")
    engine_fingerprint(record, probe)
    if results["error"]:
        log(f"guard under load, {server}, {cache}: did not run: {results['error'][:300]}")
    return read_record(write_record(record, path))
