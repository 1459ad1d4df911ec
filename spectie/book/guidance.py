"""The guidance chapter's evidence from the recorded vLLM runs: what ran and what speculation changed, the tie-stop
detector on their stops, and the thresholds both tools use. The chapter's other sections: the classifier
(spectie.book.guidance_classifier), the detector's survey and the guard (spectie.book.guidance_survey).

    page = guidance.context(model, threshold, environment)   # what every section reads
    values = guidance.evidence_values(page)                  # the first section's glue values, by name
"""

from __future__ import annotations

from dataclasses import dataclass

from spectie.tools import thresholds, tiestop
from spectie.book.claims import Claim, covering
from spectie.records.completions import baseline_run, stopped_earlier, tokens_written
from spectie.book.incident import b200_facts, fp32_row, logit_comparison
from spectie.records.record_types import Record


def detector_rows(records: list[Record], threshold: float) -> list[dict]:
    """One row per reproduction record that ran: how its first repeat ended, and whether the tie-stop
    detector flags that stop (from the stop margin vLLM's own top-2 logprobs gave)."""
    rows = []
    for record in records:
        if not record.results.repeats:
            continue
        repeat = record.results.repeats[0]
        stop = repeat.get("stop_margin")
        row = {"configuration": record.parameters.configuration, "finish": repeat["finish_reason"],
               "tokens written": tokens_written(repeat), "stop token": None, "margin": None, "runner-up": None,
               "flagged": None}
        if stop:
            row.update({"stop token": stop["stop_token"], "margin": stop["margin"], "runner-up": stop["runner_up"],
                        "flagged": tiestop.is_near_tie(stop["margin"], threshold)})
        rows.append(row)
    return rows


def yes_no(value) -> str:
    """A table's boolean in words."""
    return {True: "yes", False: "no"}.get(value, "—")


def outcome(repeat: dict) -> str:
    """How one recorded completion ended, in words."""
    if repeat["finish_reason"] == "stop":
        return f"stop after {tokens_written(repeat)} tokens"
    return f"the {repeat['output_tokens']}-token limit ({repeat['finish_reason']})"


def grouped_outcomes(repeats: dict[str, dict]) -> str:
    """'a, b: stop after 55 tokens; c: the 96-token limit (length)' for named completions (insertion order)."""
    groups: dict[str, list[str]] = {}
    for name, repeat in repeats.items():
        groups.setdefault(outcome(repeat), []).append(name)
    return "; ".join(f"{', '.join(names)}: {text}" for text, names in groups.items())


def fp32_head_bands(records: list[Record]) -> str | None:
    """The bf16 noise band with the bf16 head and with an fp32 head, per recorded sweep that has both
    (torch kernels, TF32 off), in words; None when no sweep has an fp32-head row."""
    from spectie.lab.bands import band_points
    from spectie.lab.reduction_order import FP32_HEAD

    parts = []
    for record in records:
        points = {p["dtype"]: p for p in band_points([record]) if p["kernels"] == "torch" and not p["tf32"]}
        plain, head = points.get("bfloat16"), points.get("bfloat16" + FP32_HEAD)
        if plain and head:
            where = plain["label"].rsplit(" · ", 1)[0]
            if record.device == "CPU":  # CPUs of different hosts round differently: name which one
                where += f" (host {record.fingerprint.host_id})"
            parts.append(f"{where}: band {head['band']:.3f} logits with an fp32 head "
                         f"against {plain['band']:.3f} with the bf16 head ({head['band'] / plain['band']:.0%} of it)")
    if not parts:
        return None
    return ("; ".join(parts) + ". An fp32 head removes the rounding of the logits themselves (the bf16 steps a "
            "logprob margin moves in), not the reordered sums of the body that move the hidden states")


def batch_invariant_text(runs: list[Record], baseline: Record | None) -> str:
    """What the recorded batch-invariant configurations did, in words."""
    chosen = [r for r in runs if r.parameters.batch_invariant]
    if not chosen:
        return "not measured yet: no record of a batch-invariant configuration"
    parts = []
    for record in chosen:
        results = record.results
        platform = record.fingerprint.vllm_platform or results.backend or "?"
        name = f"{record.parameters.configuration} (vLLM {record.fingerprint.vllm}, {platform})"
        if results.status == "ok" and results.repeats:
            same = baseline and results.repeats[0]["token_ids"] == baseline.results.repeats[0]["token_ids"]
            parts.append(f"{name} ran: {'the same completion as' if same else 'a different completion from'} plain greedy")
        else:
            message = (results.error or {}).get("message", "").strip().splitlines()
            parts.append(f"{name}: {results.status}" + (f", vLLM said: {message[-1][:160]}" if message else ""))
    return "; ".join(parts)


def runs_scope(runs: list[Record]) -> str:
    """Which runs a sentence over `runs` covers, in words: 'the 9 configurations of vLLM 0.32.0 (CPU, host x) on
    prompt seed 0'."""
    if not runs:
        return "no recorded run"
    seeds = sorted({r.parameters.prompt_seed for r in runs})
    first = runs[0]
    return (f"the {plural(len({r.parameters.configuration for r in runs}), 'configuration')} of vLLM "
            f"{first.fingerprint.vllm} ({first.device}, host {first.fingerprint.host_id}) on prompt "
            f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}")


def ends_text(baseline: dict | None, changed: dict[str, dict], scope: str = "these runs") -> str:
    """Whether speculation moved where the completions end, in words: `changed` maps each configuration that
    wrote other tokens than plain greedy to its first repeat; `baseline` is plain greedy's first repeat."""
    if baseline is None or not changed:
        return f"In {scope}, no speculative completion differs from plain greedy's, so nothing moved"
    moved = [name for name, repeat in changed.items() if _end(repeat) != _end(baseline)]
    if moved:
        return (f"In {scope}, where the completion ends moved for {', '.join(moved)}: a near-tie flipped early in the "
                "completion changes everything after it")
    return (f"In {scope}, every changed completion ended where plain greedy's did ({outcome(baseline)}): there, "
            "speculation changed tokens, not where the completion stops")


def _end(repeat: dict) -> tuple:
    return repeat["finish_reason"], repeat["output_tokens"]


def ends_facts(runs: list[Record]) -> dict:
    """Which speculative configurations wrote other tokens than plain greedy on their first repeat, and which of
    those ended elsewhere, over every matrix run and prompt seed in `runs`: what `ends_text` states."""
    from spectie.book.reproduce import by_run_and_prompt

    changed, moved = set(), set()
    for group in by_run_and_prompt(runs):
        base, differ = changed_completions(group)
        changed |= set(differ)
        moved |= {name for name, repeat in differ.items() if _end(repeat) != _end(base)}
    return {"changed": sorted(changed), "moved": sorted(moved)}


def ends_claim(runs: list[Record]) -> Claim:
    """`ends_text` over `runs`, as a claim naming them."""
    base, changed = changed_completions(runs)
    words = runs_scope(runs)
    return Claim("ends_text", ends_text(base, changed, words), covering(runs, words, "engine-outcome"),
                 "spectie.book.guidance:ends_facts", ends_facts(runs))


def stops_facts(runs: list[Record], threshold: float) -> dict:
    """How many first repeats of `runs` ended on a stop token, and how many of those stops the detector flags at
    `threshold`: what `stops_text` states."""
    stops = [row for row in detector_rows(runs, threshold) if row["finish"] == "stop"]
    return {"stops": len(stops), "flagged": sum(1 for row in stops if row["flagged"])}


def stops_text(margins: list[float], flagged: int, threshold: float, scope: str = "these runs") -> str:
    """The detector on the recorded stops of the runs `scope` names, in words."""
    if not margins:
        return f"No run of {scope} stopped before its token limit, so the detector had no stop of theirs to judge"
    return (f"The stops of {scope} won by {min(margins):.2f} to {max(margins):.2f} logits: {flagged} of "
            f"{len(margins)} are within the detector's threshold of {threshold:.3f} logits")


def upstream_text(changed: dict[str, dict], baseline: dict | None, divergence_at: str, suspected: int = 0) -> str:
    """Where speculation changed the completion: at the stop, or upstream of it, and whether the classifier calls
    the divergences near-ties (`suspected`: how many it calls suspected bugs), in words (the sentence follows one
    that names the runs: "these runs")."""
    if baseline is None or not changed:
        return "Speculation left every completion of these runs as plain greedy wrote it"
    stopped = [name for name, repeat in changed.items() if repeat["finish_reason"] == "stop"]
    where, found = ("at a near-tie of their own", "the tie") if not suspected else (
        f"where the classifier calls {suspected} of the divergences suspected correctness bugs", "where they part")
    text = (f"Where speculation changed the organism's completion in these runs, speculative and plain decoding first "
            f"part at output token {divergence_at} (below), {where}")
    if stopped or baseline["finish_reason"] == "stop":
        return text + (", not at the stop: a tie-stop detector sees only the stop; the classifier finds "
                       f"{found} upstream")
    return text + ("; no run stopped there, so there is no stop for a tie-stop detector to judge, and the classifier "
                   f"is the tool that finds {found}")


MIN_FOR_RATE = 10  # fewer cases than this are counted, not turned into a rate


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def rate_text(part: int, whole: int) -> str:
    """'3 of 40 (8%)', or the counts alone when there are too few for a rate."""
    if whole >= MIN_FOR_RATE:
        return f"{part} of {whole} ({part / whole:.0%})"
    return f"{part} of {whole}" + (" (too few for a rate)" if whole else "")


# ------------------------------------------------------------------------------ the chapter's evidence, from records
def model_records(model: str, **match) -> list[Record]:
    """The records under results/ matching `match` that were made with the very weights `model` names here."""
    from spectie.records.store import load_records, same_weights

    return [r for r in load_records(**match) if same_weights(r, model)]


def recorded_runs(model: str, environment: str) -> list[Record]:
    """The recorded vLLM runs of `model`'s weights in `environment`: one matrix run on one prompt (this host's where
    it made one). A record of another organism is never re-scored with this one."""
    from spectie.book.reproduce_page import one_run

    return one_run(model_records(model, chapter="reproduce", kind="engine-outcome"), environment)


def incident_flag_text(reported: list[Record]) -> str:
    """Whether the detector would flag the incident's fp32 stop at the incident's own fp32-to-bf16 swing, in words."""
    swing, _ = thresholds.reported_swing(logit_comparison(reported))
    if tiestop.is_near_tie(fp32_row(reported)["margin"], swing):
        return (f"inside the incident's own fp32-to-bf16 swing of {swing:.2f} logits, the threshold the detector "
                "uses when no band is recorded for a model: it would flag it")
    return f"outside the incident's own fp32-to-bf16 swing of {swing:.2f} logits: the detector would not flag it"


def noise_band(model: str, threshold: float | None, detector: bool = False) -> tuple[float, str]:
    """A tool's threshold and where it comes from: `threshold` as given, else the bf16 band recorded for `model`'s
    weights (on this machine's device where one is): the classifier's; with `detector`, the larger of that band
    and one bf16 step at the logits recorded for these weights (the detector reads bf16-rounded margins)."""
    if threshold is not None:
        return threshold, "given as a parameter"
    from spectie.lab.model import resolve_model

    find = thresholds.detector_threshold_for_model if detector else thresholds.threshold_for_model
    return find(resolve_model(model))


def first_repeats(runs: list[Record]) -> dict[str, dict]:
    """Each run's first repeat, by configuration (runs without a repeat left out)."""
    return {r.parameters.configuration: r.results.repeats[0] for r in runs if r.results.repeats}


def speculative_runs(runs: list[Record]) -> list[Record]:
    """The runs other than the baseline that completed (status ok)."""
    baseline = baseline_run(runs)
    return [r for r in runs if r.results.status == "ok" and r is not baseline]


def changed_completions(runs: list[Record]) -> tuple[dict | None, dict[str, dict]]:
    """The baseline's first repeat (None without one), and the first repeat of each speculative run that wrote other
    tokens than it, by configuration."""
    baseline = baseline_run(runs)
    first = first_repeats(runs)
    base = first.get(baseline.parameters.configuration) if baseline else None
    if base is None:
        return None, {}
    changed = {}
    for r in speculative_runs(runs):
        name = r.parameters.configuration
        if first[name]["token_ids"] != base["token_ids"]:
            changed[name] = first[name]
    return base, changed


def run_facts(runs: list[Record]) -> dict:
    """The glue values that describe the recorded runs: what ran, what speculation changed, how the runs ended and
    whether their repeats agreed."""
    base, changed = changed_completions(runs)
    ran = speculative_runs(runs)
    first = first_repeats(runs)
    mtp = {r.parameters.num_speculative_tokens: first[r.parameters.configuration] for r in ran
           if r.parameters.method == "mtp"}
    determinism = determinism_facts(runs)
    failed = [r for r in runs if r.results.status != "ok"]
    return {
        "vllm_version": runs[0].fingerprint.vllm if runs else "—",
        "speculative_ran": len(ran),
        "speculative_changed": len(changed),
        "speculative_earlier": sum(1 for r in ran if base and stopped_earlier(r.results.repeats[0], base)),
        "baseline_outcome": outcome(base) if base else "—",
        "changed_outcomes": grouped_outcomes(changed) or "none",
        "k_outcomes": grouped_outcomes({f"K = {k}": mtp[k] for k in sorted(mtp)}) or "no MTP run recorded",
        **determinism,
        "determinism_text": determinism_claim(runs),
        "failed_names": ", ".join(f"{r.parameters.configuration} ({r.results.status})" for r in failed)
        or "none",
        "ends_text": ends_claim(runs), "changed_text": changed_claim(runs), "runs_scope": runs_scope(runs),
        "batch_invariant_text": batch_invariant_text(runs, baseline_run(runs)),
    }


def changed_facts(runs: list[Record]) -> dict:
    """Over every matrix run and prompt seed in `runs`: which speculative configurations ran, which wrote other
    tokens than plain greedy on their first repeat, and the most distinct outputs over repeats (`changed_claim`)."""
    from spectie.book.reproduce import by_run_and_prompt

    ran, changed = set(), set()
    for group in by_run_and_prompt(runs):
        ran |= {r.parameters.configuration for r in speculative_runs(group)}
        changed |= set(changed_completions(group)[1])
    return {"ran": sorted(ran), "changed": sorted(changed), "distinct_max": determinism_facts(runs)["distinct_max"]}


def changed_claim(runs: list[Record]) -> Claim:
    """How many speculative configurations of `runs` wrote another completion than plain greedy, how each ended,
    and whether repeats agreed, as a claim naming the runs."""
    base, changed = changed_completions(runs)
    facts, words = changed_facts(runs), runs_scope(runs)
    distinct = facts["distinct_max"]
    repeats = "every repeat identical" if distinct == 1 else f"up to {distinct} distinct outputs per configuration"
    text = (f"in {words}, {len(changed)} of the {len(speculative_runs(runs))} speculative configurations that ran "
            f"wrote a different completion from plain greedy (plain greedy: {outcome(base) if base else '—'}; "
            f"{grouped_outcomes(changed) or 'none'}), {repeats}")
    return Claim("changed_text", text, covering(runs, words, "engine-outcome"), "spectie.book.guidance:changed_facts",
                 facts)


def determinism_facts(runs: list[Record]) -> dict:
    """The most distinct outputs any of `runs` wrote over its repeats, and the most repeats one ran."""
    return {"distinct_max": max((r.results.distinct_outputs for r in runs if r.results.repeats), default=0),
            "repeats_each": max((r.results.runs_total for r in runs), default=0)}


def determinism_claim(runs: list[Record]) -> Claim:
    """Whether the repeats of `runs` agreed, as a claim naming the runs."""
    facts, words = determinism_facts(runs), runs_scope(runs)
    verdict = ("deterministic: every repeat wrote the same output" if facts["distinct_max"] == 1
               else "not deterministic: repeats differ")
    text = (f"in {words}, at most {facts['distinct_max']} distinct output(s) over {facts['repeats_each']} repeats "
            f"per configuration: {verdict}")
    return Claim("determinism_text", text, covering(runs, words, "engine-outcome"),
                 "spectie.book.guidance:determinism_facts", facts)


def rows_claim(runs: list[Record], rows: list[dict], model: str) -> Claim:
    """The data rows each run wrote against plain greedy's (`rows`: guidance_rows.row_counts), as a claim naming
    the runs."""
    from spectie.book.guidance_rows import rows_facts, rows_text

    baseline = baseline_run(runs)
    words = runs_scope(runs)
    text = f"in {words}, " + rows_text(rows, baseline and baseline.parameters.configuration)
    return Claim("rows_text", text, covering(runs, words, "engine-outcome"), "spectie.book.guidance_rows:rows_facts",
                 rows_facts(runs, model), {"model": model})


def detector_facts(rows: list[dict], threshold: float, scope: str = "these runs") -> dict:
    """The glue values of the tie-stop detector on the recorded stops (rows from detector_rows) of the runs `scope`
    names."""
    stops = [r for r in rows if r["finish"] == "stop"]
    flagged = sum(1 for r in stops if r["flagged"])
    margins = [r["margin"] for r in stops if r["margin"] is not None and r["margin"] == r["margin"]]  # not NaN
    return {"stops_total": len(stops), "stops_flagged": flagged,
            "stops_text": stops_text(margins, flagged, threshold, scope)}


def decisive_facts(records: list[Record]) -> dict:
    """The glue values of fp32's margin and winner at the decisive position, from the first of the margins chapter's
    logit comparisons (`records`); nan and '—' without one."""
    if not records:
        return {"decisive_fp32": float("nan"), "decisive_winner": "—"}
    fp32 = {row["dtype"]: row for row in records[0].results.rows}["fp32"]
    return {"decisive_fp32": fp32["margin"], "decisive_winner": fp32["winner"]}


# ------------------------------------------------------------------------------ the page's context and first section
@dataclass(frozen=True)
class Page:
    """What every section of the guidance chapter reads: the model, the environment whose runs it examines, the
    tools' thresholds (given, or the bf16 band recorded for these weights) and the recorded runs."""
    model: str
    environment: str
    threshold: float  # the classifier's
    origin: str
    tie_threshold: float  # the detector's: at least one bf16 step at these weights' logits
    tie_origin: str
    reported: list[Record]  # the incident's records
    runs: list[Record]  # this environment's recorded vLLM runs of these weights (one matrix run, one prompt)
    largest: dict  # the widest bf16 band recorded (bands.largest_bf16_band)

    @property
    def baseline(self) -> Record | None:
        return baseline_run(self.runs)


def context(model: str, threshold: float | None, environment: str) -> Page:
    """The page's context; `threshold` None: the bands recorded for `model`'s weights."""
    from spectie.records.store import load_records
    from spectie.lab.bands import largest_bf16_band, recorded_band_points

    tie_threshold, tie_origin = noise_band(model, threshold, detector=True)
    band, origin = noise_band(model, threshold)
    return Page(model, environment, band, origin, tie_threshold, tie_origin, load_records(provenance="reported"),
                recorded_runs(model, environment), largest_bf16_band(recorded_band_points()))


def evidence_values(page: Page) -> dict:
    """The glue values of the chapter's first section: the incident's stop and the thresholds, the recorded runs,
    the detector on their stops (a table), the margins chapter's fp32 check, the fp32-head band and the runs'
    data rows (a table)."""
    import pandas as pd

    from spectie.book import guidance_rows
    from spectie.lab.model import resolve_model
    from spectie.records.store import load_records

    detector = detector_rows(page.runs, page.tie_threshold)
    words = runs_scope(page.runs)
    detected = detector_facts(detector, page.tie_threshold, words)
    rows = guidance_rows.row_counts(page.runs, resolve_model(page.model))
    baseline = page.baseline
    head = fp32_head_bands(load_records(chapter="reduction_order", kind="reduction-sweep"))  # every model's sweeps
    margins = [r for r in model_records(page.model, chapter="margins", kind="logit-comparison", provenance="measured")
               if r.environments == (page.environment,)]
    return {
        "incident_margin": fp32_row(page.reported)["margin"], "incident_flag_text": incident_flag_text(page.reported),
        "threshold": page.threshold, "threshold_origin": page.origin, "tie_threshold": page.tie_threshold,
        "tie_threshold_origin": page.tie_origin, "largest_label": page.largest["label"],
        "largest_band": page.largest["band"], "largest_order": page.largest["order"],
        **run_facts(page.runs), **b200_facts(page.reported),
        **detected, "stops_text": Claim("stops_text", detected["stops_text"],
                                        covering(page.runs, words, "engine-outcome"),
                                        "spectie.book.guidance:stops_facts", stops_facts(page.runs, page.tie_threshold),
                                        {"threshold": page.tie_threshold}),
        "detector_table": pd.DataFrame(detector).style.format(precision=3, na_rep="—")
        .format({"flagged": yes_no}, na_rep="—").hide(axis="index"),
        **decisive_facts(margins),
        "fp32_head_text": head or "not measured yet: no record of a `bfloat16+fp32-head` sweep",
        "rows_text": rows_claim(page.runs, rows, page.model),
        "integrity_table": pd.DataFrame(rows).style.hide(axis="index"),
    }
