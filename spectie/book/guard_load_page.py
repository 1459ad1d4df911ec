"""What the guard-under-load records say (spectie.engines.guard_load), per device: for each server, prefix-caching setting,
level, workload and route, how many requests stopped earlier than plain greedy's one-at-a-time output, how many
outputs differ from the same server's one-at-a-time output, near-tie stops that reached the client, errors,
throughput and latency; and, in words, whether load or prefix caching moved a stop.

Every comparison is made within one device's records (one environment on one host): the reference of a prompt is
plain greedy's output one at a time (level 1, straight) with prefix caching off where recorded, else on; a device
without plain greedy compares no stop with it. One comparison crosses hosts, and says so: prefix caching on against
off for a server that no one host measured both ways, on two hosts of the same environment and GPU (or CPU) model.
"""

from __future__ import annotations

from collections import defaultdict

from spectie.engines.guard_load import KIND, SERVERS
from spectie.book.pages import and_list, bullets, device_of
from spectie.records.record_types import Record
from spectie.records.store import load_records, provenance_line, same_weights

NOT_RUN = ("not run yet for this model: make run CHAPTER=guidance ENV=cpu PARAMS=environments/runs/cpu-guard-load.yaml "
           "runs it on the CPU build, and PARAMS=environments/runs/v0.32.0-h100-guard-load.yaml with ENV=v0.32.0-h100 "
           "on an H100 or H200")  # glued as text: no Markdown


def short_device(record: Record) -> str:
    """The device as a table's row label: environment and host (the sentence above the table names the CPU or GPU)."""
    return f"{record.environment}, host {record.fingerprint.host_id}"


def by_device(records: list[Record]) -> dict[str, list[Record]]:
    grouped = defaultdict(list)
    for record in records:
        grouped[device_of(record)].append(record)
    return dict(grouped)


def _alone(records: list[Record]) -> dict:
    """Each (server, prefix caching, route, prompt)'s one-at-a-time answer: (digest, finish_reason, tokens)."""
    alone = {}
    for r in records:
        for row in r.results.rows or []:
            if row["level"] == 1 and not row["error"]:
                alone[(r.parameters.server, r.parameters.prefix_caching, row["route"], row["prompt"])] = \
                    (row["digest"], row["finish_reason"], row["output_tokens"])
    return alone


def plain_reference(records: list[Record]) -> dict[str, tuple]:
    """Plain greedy's one-at-a-time answer per prompt (straight; prefix caching off where recorded, else on)."""
    alone = _alone(records)
    reference = {}
    for cache in (True, False):  # off last: it wins where both are recorded
        reference.update({key[3]: value for key, value in alone.items()
                          if key[:3] == ("plain", cache, "straight")})
    return reference


def earlier(row: dict, reference: tuple | None) -> bool:
    """Stopped (end-of-text) before plain greedy's one-at-a-time output ended."""
    return (reference is not None and row.get("finish_reason") == "stop"
            and row["output_tokens"] < reference[2])


def _percentile(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def cells(records: list[Record]) -> list[dict]:
    """One row per (server, prefix caching, level, workload, route) of one device's records."""
    alone, reference = _alone(records), plain_reference(records)
    table = []
    for r in records:
        server, cache = r.parameters.server, r.parameters.prefix_caching
        groups = defaultdict(list)
        for row in r.results.rows or []:
            groups[(row["level"], row["workload"], row["route"])].append(row)
        walls = {(b["level"], b["workload"], b["route"]): b for b in r.results.batches or []}
        for (level, workload, route), rows in sorted(groups.items()):
            done = [row for row in rows if not row["error"]]
            own = [alone.get((server, cache, route, row["prompt"])) for row in done]
            batch = [b for k, b in walls.items() if k == (level, workload, route)]
            table.append({
                "server": server, "prefix caching": "on" if cache else "off", "level": level, "workload": workload,
                "route": route, "requests": len(rows), "errors": len(rows) - len(done),
                "earlier than plain": sum(earlier(row, reference.get(row["prompt"])) for row in done) if reference
                else None,  # no plain greedy answer on this device: nothing to compare a stop with
                "differ from one at a time": sum(o is not None and row["digest"] != o[0] for row, o in zip(done, own)),
                "near-tie stops reaching the client": sum(bool(row.get("near_tie_stop")) for row in done),
                "resumed": sum((row.get("resumed") or 0) > 0 for row in done),
                "tokens/s": sum(b["tokens_per_second"] or 0 for b in batch) / max(len(batch), 1),
                "p50 s": _percentile([row["seconds"] for row in done], 50),
                "p95 s": _percentile([row["seconds"] for row in done], 95)})
    return table


def error_head(error: str) -> str:
    """vLLM's error without the traceback lines its log tail carries (the log's path within the project)."""
    import re

    kept = []
    for part in error.split("; "):
        if '.py"' in part or "^^^" in part:  # a traceback's frame: the log holds the rest
            break
        kept.append(re.sub(r"/\S*?/(_build/logs/)", r"\1", part))
    return "; ".join(kept)[:240]


def failed(records: list[Record]) -> list[str]:
    """The servers that did not start, with vLLM's error: one line per device, error and the project's commit (its
    environment lock installed that server), naming its servers."""
    servers = defaultdict(list)
    for r in records:
        if r.results.error:
            setting = f"{r.parameters.server} (prefix caching {'on' if r.parameters.prefix_caching else 'off'})"
            commit = r.fingerprint.source_commit
            servers[(device_of(r), error_head(r.results.error), commit[:7] if commit else None)].append(setting)
    return [f"on {device}, {and_list(sorted(names))}: {error}" + (f" (project at commit {commit})" if commit else "")
            for (device, error, commit), names in servers.items()]


def answered(records: list[Record]) -> bool:
    """Did any server of these records answer a request (a device whose servers all failed to start measured nothing)?"""
    return any(not row["error"] for r in records for row in r.results.rows or [])


def nothing_measured(records: list[Record]) -> str:
    """What a device whose servers all failed measured: nothing, with how many failed and the first error's head."""
    errors = [r.results.error for r in records if r.results.error]
    head = f" ({error_head(errors[0])})" if errors else ""
    return (f"nothing measured: {len(errors)} of {len(records)} servers did not start{head}, and no request was "
            "answered")


def load_sentence(device: str, records: list[Record], others: list[Record] = ()) -> str:
    """Whether load (levels above 1) or prefix caching moved a stop or changed an output, on one device, in words
    computed from its cells (`others`: every load record, for what another host of the same hardware ran)."""
    if not answered(records):
        return f"on {device}: {nothing_measured(records)}"
    table = cells(records)
    loaded = [c for c in table if c["level"] > 1]
    moved = sum(c["differ from one at a time"] for c in loaded)
    earlier_alone = {(c["server"], c["prefix caching"], c["route"]): c["earlier than plain"]
                     for c in table if c["level"] == 1 and c["workload"] == "distinct"}
    compared = any(c["earlier than plain"] is not None for c in table)  # None: no plain greedy answer here
    earlier_loaded = sum(c["earlier than plain"] or 0 for c in loaded)
    levels = sorted({c["level"] for c in loaded})
    rows = [row for r in records for row in r.results.rows or [] if not row["error"]]
    stops = sum(row.get("finish_reason") == "stop" for row in rows)
    text = (f"on {device} ({settings(records)}; levels {', '.join(map(str, [1, *levels]))}): "
            f"{stops} of {len(rows)} answers ended on an end-of-text token; "
            f"{moved} of {sum(c['requests'] - c['errors'] for c in loaded)} answers under load differed from the same "
            f"server's answer one at a time; " + (
                f"{earlier_loaded} stopped earlier than plain greedy under load, against "
                f"{sum(earlier_alone.values())} one at a time" if compared else
                "no plain greedy answer was recorded there, so no stop is compared with plain greedy's"))
    by_cache = cache_effect(records)
    if by_cache is not None:
        both_ways = and_list(sorted(s for s, caches in answered_runs(records).items() if len(caches) == 2))
        text += (f"; with prefix caching on, {by_cache[0]} of {by_cache[1]} one-at-a-time answers ({both_ways}) "
                 "differed from the same server's with it off")
    missing = not_run(records, others)
    return f"{text}; {missing}" if missing else text


def answered_runs(records: list[Record]) -> dict[str, set[bool]]:
    """Per server that answered in these records, the prefix-caching settings it answered with."""
    runs = defaultdict(set)
    for r in records:
        if r.results.rows:
            runs[r.parameters.server].add(r.parameters.prefix_caching)
    return runs


def settings(records: list[Record]) -> str:
    """The servers that answered in these records, with the prefix-caching settings each answered with, in words:
    "plain with prefix caching on and off; mtp-k1 with prefix caching on"."""
    by_setting = defaultdict(list)
    for server, caches in sorted(answered_runs(records).items()):
        by_setting[frozenset(caches)].append(server)
    words = {frozenset({True, False}): "on and off", frozenset({True}): "on", frozenset({False}): "off"}
    return "; ".join(f"{and_list(by_setting[caches])} with prefix caching {said}"
                     for caches, said in words.items() if caches in by_setting)


def _hardware(record: Record) -> tuple:
    return record.environment, record.fingerprint.gpu or record.fingerprint.cpu


def recorded_elsewhere(records: list[Record], others: list[Record]) -> dict[str, list[str]]:
    """Per other host of the same environment and GPU (or CPU) model, the settings ("mtp-k1 with prefix caching on")
    its servers answered with that these records lack."""
    done = {(r.parameters.server, r.parameters.prefix_caching) for r in records}
    here = records[0].fingerprint.host_id
    found = defaultdict(set)
    for r in others:
        setting = (r.parameters.server, r.parameters.prefix_caching)
        same_hardware = r.fingerprint.host_id != here and _hardware(r) == _hardware(records[0])
        if r.results.rows and setting not in done and same_hardware:
            found[r.fingerprint.host_id].add(setting)
    return {host: [f"{server} with prefix caching {'on' if cache else 'off'}" for server in SERVERS
                   for cache in (True, False) if (server, cache) in held]
            for host, held in sorted(found.items())}


def not_run(records: list[Record], others: list[Record] = ()) -> str:
    """The servers and prefix-caching settings of the full plan (every server, caching on and off) that no record of
    this device holds, with the command that runs them there (a run resumes: what is recorded is not sent again);
    '' when all are recorded."""
    done = {(r.parameters.server, r.parameters.prefix_caching) for r in records}
    missing = {cache: [server for server in SERVERS if (server, cache) not in done] for cache in (True, False)}
    said = [f"{and_list(servers)} with prefix caching {'on' if cache else 'off'}" for cache, servers in missing.items()
            if servers]
    if not said:
        return ""
    environment = records[0].environment
    params = run_file(environment)
    text = (f"not run yet there: {'; '.join(said)} (make run CHAPTER=guidance ENV={environment} "
            f"PARAMS=environments/runs/{params})")
    elsewhere = recorded_elsewhere(records, others)
    model = "GPU" if records[0].fingerprint.gpu else "CPU"
    return text + "".join(f"; host {host}, with the same {model} model, recorded {and_list(what)}"
                          for host, what in elsewhere.items())


def run_file(environment: str) -> str:
    """The run file of the load measurement for an environment: its own (environments/runs/<env>-guard-load.yaml)
    where one exists, else the H100's (vLLM 0.32.0), which runs on any GPU of that release."""
    from spectie.records.paths import project_root

    own = f"{environment}-guard-load.yaml"
    return own if (project_root() / "environments" / "runs" / own).is_file() else "v0.32.0-h100-guard-load.yaml"


def cache_across_hosts(records: list[Record]) -> list[str]:
    """Prefix caching on against off where no one host measured both for a server but two hosts of the same
    environment and GPU (or CPU) model did: per server, how many one-at-a-time answers differ, naming both hosts (a
    difference may be the host's as well as the setting's)."""
    groups = defaultdict(lambda: defaultdict(list))  # (environment, hardware) -> host -> records
    for r in records:
        if r.results.rows:
            groups[_hardware(r)][r.fingerprint.host_id].append(r)
    said = []
    for (environment, hardware), hosts in groups.items():
        for server in SERVERS:
            with_cache = {cache: sorted(h for h, rs in hosts.items() if any(
                r.parameters.server == server and r.parameters.prefix_caching is cache for r in rs))
                for cache in (True, False)}
            if not with_cache[True] or not with_cache[False] or set(with_cache[True]) & set(with_cache[False]):
                continue
            on, off = with_cache[True][0], with_cache[False][0]
            effect = cache_effect([r for r in hosts[on] + hosts[off] if r.parameters.server == server])
            if effect:
                said.append(f"on {environment}, {hardware}, across two hosts: {server} with prefix caching on (host "
                            f"{on}) and off (host {off}): {effect[0]} of {effect[1]} one-at-a-time answers differed")
    return said


def cache_effect(records: list[Record]) -> tuple[int, int] | None:
    """(answers that differ, answers compared) between prefix caching on and off, one at a time, per server."""
    alone = _alone(records)
    pairs = [(value, alone.get((key[0], False, *key[2:]))) for key, value in alone.items() if key[1]]
    pairs = [(on, off) for on, off in pairs if off is not None]
    return (sum(on[0] != off[0] for on, off in pairs), len(pairs)) if pairs else None


# The cells' figures shown as "straight / guarded", under short headings (the text under the table says each).
PAIRED = {"earlier than plain": "earlier", "differ from one at a time": "differ",
          "near-tie stops reaching the client": "near-tie stops", "tokens/s": "tokens/s", "p50 s": "p50 s",
          "p95 s": "p95 s"}


def _pair(straight, guarded) -> str:
    shown = [("—" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)) for v in (straight, guarded)]
    return "\u00a0/\u00a0".join(shown)  # never broken across lines


OUTCOMES = ("earlier", "differ", "near-tie stops")
SPEED = ("tokens/s", "p50 s", "p95 s")


def device_table(device: str, records: list[Record], columns: tuple[str, ...]):
    """One device's cells as a table: a row per server, prefix caching, workload and level; each of `columns`
    (short names of PAIRED) as "straight / guarded"; with the outcomes, the guard's resumes and both routes' errors."""
    import pandas as pd

    by_key = defaultdict(dict)
    for c in cells(records):
        by_key[(device, c["server"], c["prefix caching"], c["workload"], c["level"])][c["route"]] = c
    order = sorted(by_key, key=lambda k: (k[1], k[2], k[3] != "distinct", k[4]))
    names = {short: name for name, short in PAIRED.items()}
    rows = []
    for key in order:
        straight, guarded = by_key[key].get("straight", {}), by_key[key].get("guarded", {})
        row = {"answers": _pair(straight.get("requests"), guarded.get("requests"))} if columns == OUTCOMES else {}
        row.update({short: _pair(straight.get(names[short]), guarded.get(names[short])) for short in columns})
        if columns == OUTCOMES:
            row.update({"resumed": guarded.get("resumed", "—"),
                        "errors": (straight.get("errors") or 0) + (guarded.get("errors") or 0)})
        rows.append(row)
    index = pd.MultiIndex.from_tuples(order, names=["device", "server", "prefix caching", "workload", "in flight"])
    return pd.DataFrame(rows, index=index)


def load_values(page) -> dict:
    """The glue values of the load section: a table (a block of rows per device), a sentence per device, the servers
    that did not start, and where every record came from."""
    import pandas as pd

    from IPython.display import Markdown

    records = [r for r in load_records(chapter="guidance", kind=KIND) if same_weights(r, page.model)]
    if not records:
        return {"load_text": Markdown(NOT_RUN), "load_table": NOT_RUN, "load_speed_table": NOT_RUN, "load_failed": "—",
                "load_provenance": "no record yet", "load_checklist": NOT_RUN, "load_levels": "—"}
    devices = by_device(records)
    tables = {columns: pd.concat([device_table(short_device(rs[0]), rs, columns) for rs in devices.values()])
              for columns in (OUTCOMES, SPEED)}
    sentences = [load_sentence(d, rs, records) for d, rs in devices.items()] + cache_across_hosts(records)
    sentences = [s.replace("_", r"\_").replace("*", r"\*") for s in sentences]  # text, not Markdown
    return {"load_text": Markdown(bullets(sentences)),
            "load_table": tables[OUTCOMES].style, "load_speed_table": tables[SPEED].style,
            "load_failed": "; ".join(f for rs in devices.values() for f in failed(rs)) or "none",
            "load_provenance": provenance_line(records), "load_checklist": checklist_text(records),
            "load_levels": and_list([str(v) for v in sorted({v for r in records for v in r.parameters.levels or []})])}


def is_gpu(record: Record) -> bool:
    return bool(record.fingerprint.gpu)


def device_totals(records: list[Record]) -> dict:
    """One device's answers under every load level: near-tie stops that reached the client straight and through the
    guard, answers resumed by the guard, errors."""
    rows = [row for r in records for row in r.results.rows or []]
    done = [row for row in rows if not row["error"]]
    return {"answers": len(done), "errors": len(rows) - len(done),
            "straight": sum(bool(row.get("near_tie_stop")) for row in done if row["route"] == "straight"),
            "guarded": sum(bool(row.get("near_tie_stop")) for row in done if row["route"] == "guarded"),
            "resumed": sum((row.get("resumed") or 0) > 0 for row in done if row["route"] == "guarded"),
            "levels": sorted({row["level"] for row in rows})}


def load_facts(records: list[Record]) -> dict:
    """What the first page's line on the guard under load states: per device its totals (or that nothing was
    measured there, unless another host of the same environment and CPU or GPU answered: a failed install there
    says nothing about the guard, and the guidance chapter keeps its error), and whether a GPU answered under it."""
    loads = [r for r in records if r.kind == KIND]
    devices = by_device(loads)
    measured = {_hardware(rs[0]) for rs in devices.values() if answered(rs)}
    return {"devices": {device: device_totals(rs) if answered(rs) else {"nothing": nothing_measured(rs)}
                        for device, rs in devices.items() if answered(rs) or _hardware(rs[0]) not in measured},
            "gpu": any(is_gpu(rs[0]) and answered(rs) for rs in devices.values())}


def summary_values(records: list[Record]) -> dict:
    """The first page's line on the guard under load, per device, and whether any GPU measured it (a claim over every
    load record: a GPU's would change it)."""
    from spectie.book.claims import Claim, Scope

    facts = load_facts(records)
    lines = []
    for device, t in facts["devices"].items():
        if "nothing" in t:
            lines.append(f"{device}: {t['nothing']}")
            continue
        lines.append(f"{device}: near-tie end-of-text stops reached the client in {t['straight']} answers straight "
                     f"and {t['guarded']} through the guard ({t['answers']} answers at "
                     f"{', '.join(map(str, t['levels']))} requests in flight; {t['resumed']} resumed, "
                     f"{t['errors']} errors; measured)")
    if not facts["gpu"]:
        lines.append("not measured on a GPU yet (make run CHAPTER=guidance ENV=v0.32.0-h100 "
                     "PARAMS=environments/runs/v0.32.0-h100-guard-load.yaml runs it on an H100 or H200)")
    return {"guard_devices": Claim("guard_devices", "; ".join(lines) if lines else NOT_RUN, Scope("", KIND),
                                   "spectie.book.guard_load_page:load_facts", facts)}


def added_latency(records: list[Record]) -> dict[int, tuple[float, float]]:
    """Per level, the guard's added seconds per request on one device: the 50th and 95th percentiles of the
    requests through the guard minus those of the same batches sent straight (every server and workload)."""
    seconds = defaultdict(list)
    for row in (row for r in records for row in r.results.rows or []):
        if not row["error"]:
            seconds[(row["level"], row["route"])].append(row["seconds"])
    return {level: tuple(_percentile(seconds[(level, "guarded")], q) - _percentile(seconds[(level, "straight")], q)
                         for q in (50, 95))
            for level in sorted({level for level, _ in seconds})
            if seconds[(level, "guarded")] and seconds[(level, "straight")]}


def moved(records: list[Record]) -> bool:
    """Did load or prefix caching change an answer or move a stop on this device?"""
    table = cells(records)
    loaded = [c for c in table if c["level"] > 1]
    cache = cache_effect(records)
    return (any(c["differ from one at a time"] or c["earlier than plain"] for c in loaded)
            or bool(cache and cache[0]))


def signed(seconds: float) -> str:
    """Seconds to two decimals with their sign; a figure that rounds to zero is +0.00, not -0.00."""
    return f"{round(seconds, 2) + 0.0:+.2f}"


def checklist_text(records: list[Record]) -> str:
    """The operator checklist's line on load, per device, from the records: what moved and what the guard cost."""
    if not records:
        return NOT_RUN
    parts = []
    for device, rs in by_device(records).items():
        if not answered(rs):
            parts.append(f"on {device}, {nothing_measured(rs)}")
            continue
        added = added_latency(rs)
        cost = ", ".join(f"{signed(p50)} s at the median and {signed(p95)} s at the 95th percentile at {level} in flight"
                         for level, (p50, p95) in added.items())
        noise = (" (a negative figure: the batches' own spread is larger than the guard's cost)"
                 if any(v < 0 for pair in added.values() for v in pair) else "")
        verdict = ("load or prefix caching changed answers there: test under your own concurrency and prefix-caching "
                   "setting, not one request at a time" if moved(rs) else
                   "neither load nor prefix caching changed an answer there: a one-at-a-time check stood for a "
                   "loaded server")
        parts.append(f"on {device}, {verdict}; a request through the guard took, against the same batch sent "
                     f"straight, {cost or 'nothing measured'}{noise}")
    return "; ".join(parts)
