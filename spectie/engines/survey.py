"""Tie-stop survey: what the detector flags among ordinary stops, and among the stops speculation moved.

A set of ordinary prompts (the organism's listings at several lengths, seeds and both templates; none of
them is the incident's prompt) is completed greedily through vLLM by the plain baseline and by each
speculative configuration, all prompts of a configuration batched in one engine, with top-2 logprobs.
A speculative completion identical to plain greedy ends where plain greedy ends: its stop is *ordinary*,
and a flag on it is a false positive. A speculative completion that differs from plain greedy was moved
by speculation: the stops the detector is for.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed

from spectie.records.errors import UsageError
from spectie.records.fingerprint import measurement_key
from spectie.lab.prompts import CHECKPOINT, LENGTHS, PromptSpec, prompt_specs
from spectie.records.record_types import Record
from spectie.records.store import recorded_measurement
from spectie.tools.tiestop import Completion, Step, check, is_near_tie

CHAPTER = "guidance"
# The files whose code computes a survey (with the weights, arguments and library versions: its measurement key).
SURVEY_SOURCES = ("spectie/engines/survey.py", "spectie/lab/prompts.py", "spectie/tools/tiestop.py",
                  "spectie/engines/runner.py", "spectie/engines/child.py", "spectie/engines/matrix.py")
INJECTION_SOURCES = ("spectie/engines/survey.py", "spectie/lab/prompts.py", "spectie/lab/model.py", "spectie/lab/tokenizer.py")


def record_path(kind: str, environment: str, results_dir=None):
    """Where this host's record of `kind` in `environment` lives (one per environment and host)."""
    from spectie.records.fingerprint import host_id
    from spectie.records.store import measured_path

    return measured_path({"environments": [environment], "fingerprint": {"host_id": host_id()}, "chapter": CHAPTER,
                          "id": f"{kind}-{environment}-{host_id()}".lower()}, results_dir)


def completion_row(event: dict) -> dict:
    return {key: event.get(key) for key in ("finish_reason", "output_tokens", "token_ids", "stop_margin", "top2_margins")}


def survey_matrix(environment: str, configurations: list[str] | None, matrix_name: str | None,
                  max_tokens: int | None):
    """The matrix of the survey: the environment's (or `matrix_name`), its baseline and `configurations`, one repeat
    each (`max_tokens` new tokens, where given); at least one speculative configuration."""
    from spectie.engines.matrix import default_matrix_name, read_matrix

    matrix = read_matrix(matrix_name or default_matrix_name(environment)).select(configurations).with_repeats(1)
    if max_tokens is not None:
        matrix = matrix.with_sampling(max_tokens=max_tokens)
    if len(matrix.configs) < 2:
        raise UsageError("the survey compares speculative configurations with the baseline: name at least one")
    return matrix


def complete_all(matrix, model: str, prompts: list[list[int]], python, probe: dict, progress: bool, log) -> dict:
    """Every configuration's engine completes every prompt (one batch per engine), `matrix.parallel` engines at a
    time on a core each, the most speculative tokens first (the slowest engine does not start last and leave a core
    idle): {configuration id: its Outcome}."""
    from tqdm import tqdm

    from spectie.engines.matrix_run import slot_environment
    from spectie.engines.runner import request_for, run_child
    from spectie.records.paths import project_root

    logs = project_root() / "_build" / "logs" / CHAPTER
    bar = tqdm(total=len(prompts) * len(matrix.configs), desc="survey", unit="completion", disable=not progress,
               file=sys.stderr)
    slots: queue.Queue = queue.Queue()  # a core per engine running now (matrix_run.slot_environment)
    for slot in range(matrix.parallel):
        slots.put(slot)

    def complete(config) -> tuple[str, object]:
        request = request_for(config, matrix, model, prompts, sequential=False)  # one batch per repeat
        slot = slots.get()
        try:
            log(f"survey: {config.id}: one engine, {len(prompts)} prompts")
            outcome = run_child(python, request, logs / f"survey-{config.id}.log",
                                lambda event: bar.update(1) if event["event"] == "repeat" else None,
                                extra_environment=slot_environment(slot, matrix.parallel, probe["platform"]))
        finally:
            slots.put(slot)
        return config.id, outcome

    try:
        with ThreadPoolExecutor(max_workers=matrix.parallel) as pool:
            return dict(pool.map(complete, sorted(matrix.configs, key=lambda c: -(c.k or 0))))
    finally:
        bar.close()


def survey_results(matrix, specs: list[PromptSpec], prompts: list[list[int]], done: dict, probe: dict) -> dict:
    """The record's results: each configuration's status and times, each prompt's completions."""
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
        completions = {c.id: completion_row(e) for c in matrix.configs for e in done[c.id].repeats
                       if e["prompt"] == number}
        rows.append({"tokens": spec.tokens, "seed": spec.seed, "template": spec.template, "prompt_tokens": len(ids),
                     "completions": completions})
    return {"vllm_version": probe["vllm_version"], "backend": probe["platform"], "configurations": configs,
            "prompts": rows}


def run(model: str, environment: str, count: int = 32, configurations: list[str] | None = None,
        matrix_name: str | None = None, content_hash: str | None = None, model_label: str | None = None,
        progress: bool = True, results_dir=None, max_tokens: int | None = None, log=print) -> Record:
    """Complete the prompts with the matrix's baseline and `configurations`; write and return the record (or
    return this host's earlier record of the same measurement)."""
    from spectie.records.chapters import current_hash
    from spectie.engines.checks import check_matrix, engine_python, probe_vllm
    from spectie.engines.runner import engine_fingerprint, request_for
    from spectie.records.fingerprint import host_id, now
    from spectie.lab.prompts import build_prompt
    from spectie.records.store import measured_path, measured_record, read_record, write_record
    from spectie.lab.tokenizer import model_tokenizer

    matrix = survey_matrix(environment, configurations, matrix_name, max_tokens)
    specs = prompt_specs(count)  # checked before any engine starts
    matrix.check_fits(max(spec.tokens for spec in specs))
    key = measurement_key("tiestop-survey", model, {
        "prompts": count, "configurations": [c.describe() for c in matrix.configs], "model_label": model_label,
        "max_tokens": max_tokens, "environment": environment}, SURVEY_SOURCES)
    earlier = recorded_measurement(record_path("tiestop-survey", environment, results_dir), key)
    if earlier is not None:
        log(f"survey: recorded earlier with the same weights, prompts, engines and code ({earlier.finished_at}), reused")
        return earlier
    python = engine_python(environment)
    probe = probe_vllm(environment, python)
    check_matrix(matrix, probe)
    prompts = [list(build_prompt(spec, model_tokenizer(model)).token_ids) for spec in specs]
    started_at = now()
    done = complete_all(matrix, model, prompts, python, probe, progress, log)
    parameters = {"model": model_label or model, "prompts": count, "prompt_lengths": list(LENGTHS),
                  "measurement_key": key, "matrix": matrix.name, "baseline": matrix.baseline,
                  "configurations": [c.describe() for c in matrix.configs],
                  "llm_kwargs": request_for(matrix.configs[0], matrix, model_label or model, [])["llm_kwargs"]}
    record = measured_record(
        record_id=f"tiestop-survey-{environment}-{host_id()}".lower(), kind="tiestop-survey", chapter=CHAPTER,
        title=f"Tie-stop survey: {count} ordinary prompts through vLLM {probe['vllm_version']} ({probe['platform']})",
        environment=environment, parameters=parameters, results=survey_results(matrix, specs, prompts, done, probe),
        started_at=started_at, content_hash=content_hash or current_hash(CHAPTER),
        dtype=str(parameters["llm_kwargs"].get("dtype")))
    engine_fingerprint(record, probe)
    return read_record(write_record(record, measured_path(record, results_dir)))


def classified(record: Record):
    """(prompt index, configuration, completion, baseline's completion of the same prompt, first divergence) for
    every completion of a survey; the divergence is None for the baseline and for an unchanged completion.
    A prompt without the baseline's completion cannot tell ordinary from moved: it is refused."""
    from spectie.records.completions import first_divergence

    baseline = record.parameters.baseline
    for index, row in enumerate(record.results.prompts):
        plain = row["completions"].get(baseline)
        if plain is None:
            raise UsageError(f"survey record {record.id!r}, prompt {index}: no completion of the baseline "
                             f"{baseline!r} (it has {', '.join(row['completions']) or 'none'}), so its completions "
                             "cannot be told ordinary or moved by speculation")
        for cid, completion in row["completions"].items():
            moved_at = first_divergence(completion["token_ids"], plain["token_ids"]) if cid != baseline else None
            yield index, cid, completion, plain, moved_at


def distinct_stops(record: Record) -> dict[str, list[dict]]:
    """The survey's stops, each counted once: *ordinary* ones are the baseline's (one per prompt; a speculative
    completion identical to it is the same stop), *moved* ones are the distinct stopped outputs that speculation
    made differ from the baseline on a prompt (several configurations writing the same output: one stop)."""
    found: dict[str, list[dict]] = {"ordinary": [], "moved": []}
    seen = set()
    for index, cid, completion, _, moved_at in classified(record):
        if completion["finish_reason"] != "stop":
            continue
        if cid == record.parameters.baseline:
            found["ordinary"].append(completion)
        elif moved_at is not None and (index, tuple(completion["token_ids"])) not in seen:
            seen.add((index, tuple(completion["token_ids"])))
            found["moved"].append(completion)
    return found


def stop_vs_continue(record: Record) -> list[dict]:
    """Every speculative completion of the survey of which it, or the baseline's, ends with a stop token at an output
    token where the other writes another token: the incident's silent early stop, or its reverse. Each: prompt index,
    configuration, which one stopped, where, and where the two first parted (at the stop, or upstream of it)."""
    found = []
    for index, cid, completion, plain, at in classified(record):
        if at is None:
            continue
        for name, stopper, other in ((cid, completion, plain), (record.parameters.baseline, plain, completion)):
            stop = len(stopper["token_ids"]) - 1
            if stopper["finish_reason"] == "stop" and len(other["token_ids"]) > stop \
                    and other["token_ids"][stop] != stopper["token_ids"][stop]:
                found.append({"prompt": index, "configuration": cid, "stopped": name, "stop_position": stop,
                              "first_divergence": at})
    return found


def pair(record: Record, index: int, configuration: str, model: str) -> dict:
    """The classifier's input (`spectie classify`) from a survey record: prompt `index` rebuilt from its spec with
    the model's tokenizer, `configuration`'s completion as a, the baseline's as b."""
    from spectie.lab.prompts import build_prompt
    from spectie.lab.tokenizer import model_tokenizer

    row = record.results.prompts[index]
    prompt = build_prompt(PromptSpec(row["tokens"], row["seed"], row["template"]), model_tokenizer(model))
    if len(prompt.token_ids) != row["prompt_tokens"]:
        raise UsageError(f"prompt {index} rebuilt with {model}'s tokenizer has {len(prompt.token_ids)} tokens, the "
                         f"survey's had {row['prompt_tokens']}: another tokenizer")
    baseline = record.parameters.baseline
    return {"prompt_token_ids": list(prompt.token_ids), "a": row["completions"][configuration]["token_ids"],
            "b": row["completions"][baseline]["token_ids"], "a_name": configuration, "b_name": baseline}


def margins_by_kind(record: Record, stops: dict[str, list[dict]] | None = None) -> dict[str, list[float]]:
    """Stop margins of the ordinary and of the moved stops, each stop once (for a plot against the threshold);
    `stops`: the record's `distinct_stops`, if already found."""
    return {kind: [c["stop_margin"]["margin"] for c in found if c["stop_margin"]]
            for kind, found in (stops or distinct_stops(record)).items()}


def margin_at(completion: dict, position: int) -> float | None:
    margins = completion.get("top2_margins") or []
    return margins[position] if position < len(margins) else None


def tally(record: Record, threshold: float) -> dict:
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
        "ordinary_flagged": sum(is_near_tie(m, threshold) for m in margins["ordinary"]),
        "moved_flagged": sum(is_near_tie(m, threshold) for m in margins["moved"]),
        "moved_tie_at_divergence": sum(m is not None and is_near_tie(m, threshold) for m in at_divergence),
    }
    counts["false_positive_rate"] = (counts["ordinary_flagged"] / counts["ordinary_stops"]
                                     if counts["ordinary_stops"] else None)
    counts["ordinary_margin_min"] = min(margins["ordinary"], default=None)
    positive = [m for _, _, c, _, _ in completions for m in c.get("top2_margins") or [] if m > 0]
    counts["margin_resolution"] = min(positive, default=None)  # smallest non-zero margin vLLM returned
    return counts


# Injected truncations: the detector's recall. -------------------------------------------------------------

INJECTION_KIND = "tiestop-injection"


def eos_logprobs(model, tokenizer, prompt_ids: list[int], new_tokens: int, eos_ids: list[int]) -> list[dict]:
    """Greedy continuation of `prompt_ids` with end-of-text suppressed (so it goes on past every place it could
    end), then, at each output position, end-of-text's logprob and the best other token's from one forward pass
    over the whole sequence, and whether the listing's grammar offers end-of-text there (right after a
    checkpoint row's `name=`: the designed tie)."""
    import torch

    from spectie.lab.model import teacher_forced_logits

    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids], device=device), max_new_tokens=new_tokens, do_sample=False,
                             suppress_tokens=eos_ids, pad_token_id=eos_ids[0], attention_mask=None)
    ids = out[0].tolist()
    start = len(prompt_ids)
    logprobs = torch.log_softmax(teacher_forced_logits(model, ids, list(range(start, len(ids)))), dim=-1)
    others = logprobs.clone()
    others[:, eos_ids] = float("-inf")
    checkpoint = tokenizer.encode(CHECKPOINT, add_special_tokens=False)
    return [{"position": i, "eos": round(float(logprobs[i, eos_ids].max()), 4),
             "eos_id": eos_ids[int(logprobs[i, eos_ids].argmax())],
             "other": round(float(others[i].max()), 4), "other_id": int(others[i].argmax()),
             "offered": ids[start + i - len(checkpoint):start + i] == checkpoint}
            for i in range(len(ids) - start)]


_INJECTION: dict = {}  # an injection worker's model and tokenizer, loaded once per process


def _load_for_injection(model: str, dtype: str) -> None:
    import torch

    from spectie.lab.model import load_model
    from spectie.lab.tokenizer import model_tokenizer

    torch.set_num_threads(1)
    _INJECTION.update(model=load_model(model, dtype), tokenizer=model_tokenizer(model))


def _inject_one(spec: PromptSpec, new_tokens: int, eos_ids: list[int]) -> list[dict]:
    from spectie.lab.prompts import build_prompt

    tokenizer = _INJECTION["tokenizer"]
    ids = list(build_prompt(spec, tokenizer).token_ids)
    return eos_logprobs(_INJECTION["model"], tokenizer, ids, new_tokens, eos_ids)


def _injected_rows(model: str, dtype: str, specs: list[PromptSpec], new_tokens: int, eos_ids: list[int],
                   progress: bool) -> list[dict]:
    """`eos_logprobs` of every prompt of `specs`, in their order. One process per core, each on one thread with the
    model loaded once, a prompt at a time: on a small model two single-threaded processes finish the prompts sooner
    than one process on two threads (and compute the same numbers: measured on the organism)."""
    from tqdm import tqdm

    rows: list = [None] * len(specs)
    workers = max(1, min(len(specs), os.cpu_count() or 1))
    bar = tqdm(total=len(specs), desc="injected truncations", unit="prompt", disable=not progress, file=sys.stderr)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_load_for_injection,
                             initargs=(model, dtype)) as pool:
        jobs = {pool.submit(_inject_one, spec, new_tokens, eos_ids): number for number, spec in enumerate(specs)}
        for job in as_completed(jobs):
            spec = specs[jobs[job]]
            rows[jobs[job]] = {"tokens": spec.tokens, "seed": spec.seed, "template": spec.template,
                               "positions": job.result()}
            bar.update(1)
    bar.close()
    return rows


def check_new_tokens(new_tokens) -> int:
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 1:
        raise UsageError(f"the injected truncations need a whole number of new tokens >= 1, got {new_tokens!r}")
    return new_tokens


def this_hosts(records: list[Record], environment: str) -> Record | None:
    """The record this host made for `environment`, else the first of `records` (None if there is none)."""
    from spectie.records.fingerprint import host_id

    here = host_id()
    return next((r for r in records if r.environment == environment and r.fingerprint.host_id == here),
                records[0] if records else None)


def inject(model: str, environment: str, count: int = 24, new_tokens: int = 200, dtype: str = "bfloat16",
           content_hash: str | None = None, model_label: str | None = None, progress: bool = True,
           results_dir=None) -> Record:
    """Plant an early end-of-text at every output position of the survey's prompts' continuations and record what
    the detector would read there: the stop token's logprob and the runner-up's, in the serving `dtype`.

    Positions where the grammar offers end-of-text are *near-tie* positions (the designed tie); every other
    position is *confident* (the model wants another token). A planted end-of-text is what a bug that forces a
    stop writes (the premature end-of-text class of vLLM #41467), with the model's own logprobs; a numerical
    flip at a near-tie reports about the same margin with the sign turned."""
    from spectie.records.chapters import current_hash
    from spectie.records.fingerprint import host_id, now
    from spectie.lab.model import torch_dtype
    from spectie.lab.tokenizer import end_of_text_ids
    from spectie.records.store import measured_path, measured_record, read_record, write_record
    from spectie.lab.tokenizer import model_tokenizer

    check_new_tokens(new_tokens)
    torch_dtype(dtype)
    specs = prompt_specs(count)
    key = measurement_key(INJECTION_KIND, model, {"prompts": count, "new_tokens": new_tokens, "dtype": dtype,
                                                  "model_label": model_label},
                          INJECTION_SOURCES)
    earlier = recorded_measurement(record_path(INJECTION_KIND, environment, results_dir), key)
    if earlier is not None:
        return earlier
    started_at = now()
    eos_ids = end_of_text_ids(model, model_tokenizer(model))
    rows = _injected_rows(model, dtype, specs, new_tokens, eos_ids, progress)
    parameters = {"model": model_label or model, "prompts": count, "prompt_lengths": list(LENGTHS),
                  "new_tokens": new_tokens, "dtype": dtype, "eos_ids": eos_ids, "measurement_key": key}
    record = measured_record(
        record_id=f"tiestop-injection-{environment}-{host_id()}".lower(), kind=INJECTION_KIND, chapter=CHAPTER,
        title=f"Injected truncations: end-of-text planted at every output position of {count} ordinary prompts",
        environment=environment, parameters=parameters, results={"prompts": rows},
        started_at=started_at, content_hash=content_hash or current_hash(CHAPTER), dtype=dtype)
    return read_record(write_record(record, measured_path(record, results_dir)))


def planted_stops(record: Record) -> dict[str, list[Completion]]:
    """The injection record's planted truncations as the detector reads them: a completion whose last step is
    the planted end-of-text, with its logprob and the runner-up's; grouped into near-tie and confident ones."""
    found: dict[str, list[Completion]] = {"near-tie": [], "confident": []}
    for index, row in enumerate(record.results.prompts):
        for p in row["positions"]:
            eos = f"#{p['eos_id']}"
            step = Step(eos, p["eos"], {eos: p["eos"], f"#{p['other_id']}": p["other"]})
            kind = "near-tie" if p["offered"] else "confident"
            found[kind].append(Completion([step], "stop", "planted", f"prompt {index}, output token {p['position']}"))
    return found


def detector_rates(survey_record: Record | None, injection_record: Record | None, threshold: float,
                   stops=None, planted=None) -> dict:
    """At `threshold`: the false-positive rate on the survey's ordinary stops (each once per prompt) and the
    recall on planted truncations at near-tie and at confident positions (tiestop.check on each), with counts."""
    rates = {"threshold": threshold}
    if survey_record is not None:
        ordinary = margins_by_kind(survey_record, stops)["ordinary"]
        flagged = sum(is_near_tie(m, threshold) for m in ordinary)
        rates.update(ordinary_stops=len(ordinary), ordinary_flagged=flagged,
                     false_positive_rate=flagged / len(ordinary) if ordinary else None)
    if injection_record is not None:
        for kind, completions in (planted or planted_stops(injection_record)).items():
            caught = sum(check(c, threshold).flagged for c in completions)
            rates.update({f"{kind} planted": len(completions), f"{kind} caught": caught,
                          f"{kind} recall": caught / len(completions) if completions else None})
    return rates


def detector_curve(survey_record: Record | None, injection_record: Record | None,
                   thresholds: list[float]) -> list[dict]:
    """`detector_rates` at each threshold (the survey's stops and the planted ones read once)."""
    stops = distinct_stops(survey_record) if survey_record is not None else None
    planted = planted_stops(injection_record) if injection_record is not None else None
    return [detector_rates(survey_record, injection_record, t, stops, planted) for t in thresholds]
