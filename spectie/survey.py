"""Tie-stop survey: what the detector flags among ordinary stops, and among the stops speculation moved.

A set of ordinary prompts (the organism's listings at several lengths, seeds and both templates; none of
them is the incident's prompt) is completed greedily through vLLM by the plain baseline and by each
speculative configuration, all prompts of a configuration batched in one engine, with top-2 logprobs.
A speculative completion identical to plain greedy ends where plain greedy ends: its stop is *ordinary*,
and a flag on it is a false positive. A speculative completion that differs from plain greedy was moved
by speculation: the stops the detector is for.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

from spectie.errors import UsageError
from spectie.prompts import TEMPLATES, PromptSpec

CHAPTER = "guidance"
LENGTHS = (256, 512, 1024, 1536)  # prompt lengths in tokens, cycled over the prompts


def prompt_specs(count: int, first_seed: int = 1) -> list[PromptSpec]:
    """`count` ordinary prompts: lengths cycle through LENGTHS, templates alternate every len(LENGTHS)."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise UsageError(f"the survey needs a whole number of prompts >= 1, got {count!r}")
    return [PromptSpec(tokens=LENGTHS[i % len(LENGTHS)], seed=first_seed + i,
                       template=TEMPLATES[(i // len(LENGTHS)) % len(TEMPLATES)]).check() for i in range(count)]


def completion_row(event: dict) -> dict:
    return {key: event.get(key) for key in ("finish_reason", "output_tokens", "token_ids", "stop_margin", "top2_margins")}


def run(model: str, environment: str, count: int = 32, configurations: list[str] | None = None,
        matrix_name: str | None = None, content_hash: str | None = None, model_label: str | None = None,
        progress: bool = True, results_dir=None, log=print) -> dict:
    """Complete the prompts with the matrix's baseline and `configurations`; write and return the record."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from spectie.fingerprint import host_id, measured_record, now
    from spectie.matrix import read_matrix
    from spectie.paths import project_root
    from spectie.prompts import build_prompt
    from spectie.records import measured_path, write_record
    from spectie.reproduce import (check_matrix, engine_python, engine_fingerprint, probe_vllm,
                                   request_for, run_child, slot_environment)

    from spectie.chapters import current_hash

    content_hash = content_hash or current_hash(CHAPTER)
    matrix_name = matrix_name or ("cpu" if environment == "cpu" else "incident")
    matrix = read_matrix(matrix_name).select(configurations).with_repeats(1)
    if len(matrix.configs) < 2:
        raise UsageError("the survey compares speculative configurations with the baseline: name at least one")
    specs = prompt_specs(count)  # checked before any engine starts
    python = engine_python(environment)
    probe = probe_vllm(environment, python)
    check_matrix(matrix, probe)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [list(build_prompt(spec, tokenizer).token_ids) for spec in specs]
    logs = project_root() / "_build" / "logs" / CHAPTER
    started_at = now()
    bar = tqdm(total=count * len(matrix.configs), desc="survey", unit="completion", disable=not progress,
               file=sys.stderr)

    def complete(slot: int, config) -> tuple[str, object]:
        request = request_for(config, matrix, model, prompts, sequential=False)  # one batch per repeat
        placement = slot_environment(slot, matrix.parallel, probe["platform"])
        log(f"survey: {config.id}: one engine, {count} prompts")
        outcome = run_child(python, request, logs / f"survey-{config.id}.log",
                            lambda event: bar.update(1) if event["event"] == "repeat" else None,
                            extra_environment=placement)
        return config.id, outcome

    try:
        with ThreadPoolExecutor(max_workers=matrix.parallel) as pool:
            done = dict(pool.map(complete, [i % matrix.parallel for i in range(len(matrix.configs))],
                                 matrix.configs))
    finally:
        bar.close()
    configs = {}
    for config in matrix.configs:
        outcome = done[config.id]
        configs[config.id] = {
            "method": config.method, "num_speculative_tokens": config.k, "status": outcome.status,
            "engine_start_seconds": outcome.engine_seconds, "seconds": outcome.seconds,
            **({"error": {**outcome.error, "log_tail": outcome.log_tail}} if outcome.error else {}),
        }
    rows = []
    for number, (spec, ids) in enumerate(zip(specs, prompts)):
        completions = {cid: completion_row(e) for cid, o in done.items() for e in o.repeats if e["prompt"] == number}
        rows.append({"tokens": spec.tokens, "seed": spec.seed, "template": spec.template, "prompt_tokens": len(ids),
                     "completions": completions})
    parameters = {"model": model_label or model, "prompts": count, "prompt_lengths": list(LENGTHS),
                  "matrix": matrix.name, "baseline": matrix.baseline,
                  "configurations": [c.describe() for c in matrix.configs],
                  "llm_kwargs": request_for(matrix.configs[0], matrix, model_label or model, [])["llm_kwargs"]}
    record = measured_record(
        record_id=f"tiestop-survey-{environment}-{host_id()}".lower(), kind="tiestop-survey", chapter=CHAPTER,
        title=f"Tie-stop survey: {count} ordinary prompts through vLLM {probe['vllm_version']} ({probe['platform']})",
        environment=environment, parameters=parameters,
        results={"vllm_version": probe["vllm_version"], "backend": probe["platform"], "configurations": configs,
                 "prompts": rows},
        started_at=started_at, content_hash=content_hash, dtype=str(parameters["llm_kwargs"].get("dtype")))
    engine_fingerprint(record, probe)
    write_record(record, measured_path(record, results_dir))
    return record


def classified(record: dict):
    """(prompt index, configuration, completion, baseline's completion of the same prompt, first divergence) for
    every completion of a survey; the divergence is None for the baseline and for an unchanged completion.
    A prompt without the baseline's completion cannot tell ordinary from moved: it is refused."""
    from spectie.reproduce import first_divergence

    baseline = record["parameters"]["baseline"]
    for index, row in enumerate(record["results"]["prompts"]):
        plain = row["completions"].get(baseline)
        if plain is None:
            raise UsageError(f"survey record {record.get('id', '')!r}, prompt {index}: no completion of the baseline "
                             f"{baseline!r} (it has {', '.join(row['completions']) or 'none'}), so its completions "
                             "cannot be told ordinary or moved by speculation")
        for cid, completion in row["completions"].items():
            moved_at = first_divergence(completion["token_ids"], plain["token_ids"]) if cid != baseline else None
            yield index, cid, completion, plain, moved_at


def distinct_stops(record: dict) -> dict[str, list[dict]]:
    """The survey's stops, each counted once: *ordinary* ones are the baseline's (one per prompt; a speculative
    completion identical to it is the same stop), *moved* ones are the distinct stopped outputs that speculation
    made differ from the baseline on a prompt (several configurations writing the same output: one stop)."""
    found: dict[str, list[dict]] = {"ordinary": [], "moved": []}
    seen = set()
    for index, cid, completion, _, moved_at in classified(record):
        if completion["finish_reason"] != "stop":
            continue
        if cid == record["parameters"]["baseline"]:
            found["ordinary"].append(completion)
        elif moved_at is not None and (index, tuple(completion["token_ids"])) not in seen:
            seen.add((index, tuple(completion["token_ids"])))
            found["moved"].append(completion)
    return found


def margins_by_kind(record: dict, stops: dict[str, list[dict]] | None = None) -> dict[str, list[float]]:
    """Stop margins of the ordinary and of the moved stops, each stop once (for a plot against the threshold);
    `stops`: the record's `distinct_stops`, if already found."""
    return {kind: [c["stop_margin"]["margin"] for c in found if c["stop_margin"]]
            for kind, found in (stops or distinct_stops(record)).items()}


def margin_at(completion: dict, position: int) -> float | None:
    margins = completion.get("top2_margins") or []
    return margins[position] if position < len(margins) else None


def tally(record: dict, threshold: float) -> dict:
    """Counts of the survey at `threshold`: completions, stops (each once: `distinct_stops`), ordinary stops
    flagged (false positives),
    moved stops flagged, moved completions whose first divergence was itself a near-tie (the top-2 margin
    vLLM reported there, in the baseline's run or the speculative one, inside the threshold), the smallest
    ordinary stop margin."""
    completions = list(classified(record))
    stopped = [c for _, _, c, _, _ in completions if c["finish_reason"] == "stop"]
    moved = [(c, plain, at) for _, _, c, plain, at in completions if at is not None]
    at_divergence = [min((m for m in (margin_at(plain, at), margin_at(c, at)) if m is not None), default=None)
                     for c, plain, at in moved]
    stops = distinct_stops(record)
    margins = margins_by_kind(record, stops)
    counts = {
        "completions": len(completions), "moved": len(moved), "stops": len(stops["ordinary"]) + len(stops["moved"]),
        "stopped_completions": len(stopped), "not_stopped": len(completions) - len(stopped),
        "no_logprobs": sum(c["stop_margin"] is None for kind in stops.values() for c in kind),
        "ordinary_stops": len(margins["ordinary"]), "moved_stops": len(margins["moved"]),
        "ordinary_flagged": sum(m < threshold for m in margins["ordinary"]),
        "moved_flagged": sum(m < threshold for m in margins["moved"]),
        "moved_tie_at_divergence": sum(m is not None and m < threshold for m in at_divergence),
    }
    counts["false_positive_rate"] = (counts["ordinary_flagged"] / counts["ordinary_stops"]
                                     if counts["ordinary_stops"] else None)
    counts["ordinary_margin_min"] = min(margins["ordinary"], default=None)
    positive = [m for _, _, c, _, _ in completions for m in c.get("top2_margins") or [] if m > 0]
    counts["margin_resolution"] = min(positive, default=None)  # smallest non-zero margin vLLM returned
    return counts
