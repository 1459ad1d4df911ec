"""The guidance chapter's evidence: the tie-stop detector and the divergence classifier applied to the
recorded vLLM runs, and the classifier on a planted state bug."""

from __future__ import annotations

from spectie import divergence, tiestop
from spectie.engines.runner import stopped_earlier, tokens_written


def detector_rows(records: list[dict], threshold: float) -> list[dict]:
    """One row per reproduction record that ran: how its first repeat ended, and whether the tie-stop
    detector flags that stop (from the stop margin vLLM's own top-2 logprobs gave)."""
    rows = []
    for record in records:
        results = record["results"]
        if not results["repeats"]:
            continue
        repeat = results["repeats"][0]
        stop = repeat.get("stop_margin")
        row = {"configuration": record["parameters"]["configuration"], "finish": repeat["finish_reason"],
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


def speculative_divergences(records: list[dict]) -> list[tuple[dict, dict]]:
    """(record, its baseline) for every reproduction record whose first repeat diverged from the baseline."""
    by_name = {r["parameters"]["configuration"]: r for r in records}
    pairs = []
    for record in records:
        baseline = by_name.get(record["parameters"].get("baseline"))
        repeats = record["results"]["repeats"]
        if baseline is not None and baseline is not record and repeats and repeats[0].get("first_divergence") is not None:
            pairs.append((record, baseline))
    return pairs


def classifier_row(name: str, result: divergence.Divergence) -> dict:
    return {"pair": name, "verdict": result.verdict,
            "first divergence (output token)": None if result.position is None else result.position + 1,
            "tokens (a / b)": f"{result.text_a!r} / {result.text_b!r}", "fp32 margin": result.reference_margin,
            "bf16 margin": result.serving_margin, "a outside the band": len(result.outside_band_a),
            "b outside the band": len(result.outside_band_b), "threshold": result.threshold}


def suspected_text(results: list[tuple[dict, divergence.Divergence]]) -> str:
    """What the classifier found among recorded vLLM runs that is not a near-tie, in words (for the page)."""
    suspected = [(record, result) for record, result in results if result.verdict == divergence.SUSPECTED_BUG]
    if not suspected:
        return "no divergence is a suspected bug: every one is a near-tie."
    parts = []
    for record, result in suspected:
        worst = max(result.outside_band_a, key=lambda t: t["gap"], default=None)
        parts.append(f"{record['parameters']['configuration']} ({len(result.outside_band_a)} tokens outside the band"
                     + (f", up to {worst['gap']:.1f} logits below the fp32 reference's choice" if worst else "") + ")")
    text = ("the classifier calls " + ", ".join(parts) + " a suspected correctness bug: numerics move a margin by "
            "tenths of a logit, not by several logits.")
    if any(record["parameters"]["method"] in ("ngram", "ngram_gpu") for record, _ in suspected):
        text += (" vLLM #39273 reports a bug of this class for ngram speculation on Qwen3.5 (a GDN state read from the "
                 "wrong slot after accepted drafts; reported, not verified here on Qwen3.5 weights): with ngram, check "
                 "that your vLLM carries its fixes before putting an early stop down to a tie.")
    return text


def fp32_head_bands(records: list[dict]) -> str | None:
    """The bf16 noise band with the bf16 head and with an fp32 head, per recorded sweep that has both
    (torch kernels, TF32 off), in words; None when no sweep has an fp32-head row."""
    from spectie.reduction_order import FP32_HEAD, band_points

    parts = []
    for record in records:
        points = {p["dtype"]: p for p in band_points([record]) if p["kernels"] == "torch" and not p["tf32"]}
        plain, head = points.get("bfloat16"), points.get("bfloat16" + FP32_HEAD)
        if plain and head:
            parts.append(f"{plain['label'].rsplit(' · ', 1)[0]}: band {head['band']:.3f} logits with an fp32 head "
                         f"against {plain['band']:.3f} with the bf16 head ({head['band'] / plain['band']:.0%} of it)")
    if not parts:
        return None
    return ("; ".join(parts) + ". An fp32 head removes the rounding of the logits themselves (the bf16 steps a "
            "logprob margin moves in), not the reordered sums of the body that move the hidden states")


def batch_invariant_text(runs: list[dict], baseline: dict | None) -> str:
    """What the recorded batch-invariant configurations did, in words."""
    chosen = [r for r in runs if r["parameters"].get("batch_invariant")]
    if not chosen:
        return "not measured yet: no record of a batch-invariant configuration"
    parts = []
    for record in chosen:
        results = record["results"]
        platform = record["fingerprint"].get("vllm_platform") or results.get("backend") or "?"
        name = f"{record['parameters']['configuration']} (vLLM {record['fingerprint'].get('vllm')}, {platform})"
        if results["status"] == "ok" and results["repeats"]:
            same = baseline and results["repeats"][0]["token_ids"] == baseline["results"]["repeats"][0]["token_ids"]
            parts.append(f"{name} ran: {'the same completion as' if same else 'a different completion from'} plain greedy")
        else:
            message = (results.get("error") or {}).get("message", "").strip().splitlines()
            parts.append(f"{name}: {results['status']}" + (f", vLLM said: {message[-1][:160]}" if message else ""))
    return "; ".join(parts)


def planted_bug(model: str = "organism", prompt_tokens: int = 1845, seed: int = 0, new_tokens: int = 96,
                corrupt_at: int = 0) -> tuple[list[int], list[int], list[int]]:
    """The prompt, plain bf16 greedy output, and the output with GDN states lost from `corrupt_at` on."""
    from spectie.model import greedy_generate, load_model, reference_gdn_kernels, resolve_model
    from spectie.prompts import PromptSpec, build_prompt
    from spectie.tokenizer import model_tokenizer

    path = resolve_model(model)
    tokenizer = model_tokenizer(path)
    prompt = list(build_prompt(PromptSpec(tokens=prompt_tokens, seed=seed), tokenizer).token_ids)
    eos = [tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    with reference_gdn_kernels():
        loaded = load_model(path, "bfloat16")
        plain = greedy_generate(loaded, prompt, new_tokens, eos).output_ids
        buggy = divergence.greedy_with_bug(loaded, prompt, new_tokens, eos, "lost-state", corrupt_at)
    return prompt, plain, buggy


def row_counts(records: list[dict], model_path: str, marker: str = "[DATA]") -> list[dict]:
    """The integrity check a caller can make: data rows in each run's output (first repeat)."""
    from spectie.tokenizer import model_tokenizer

    tokenizer = model_tokenizer(model_path)
    rows = []
    for record in records:
        if record["results"]["repeats"]:
            repeat = record["results"]["repeats"][0]
            text = tokenizer.decode(repeat["token_ids"])
            rows.append({"configuration": record["parameters"]["configuration"], "finish": repeat["finish_reason"],
                         "tokens written": tokens_written(repeat), f"{marker} rows written": text.count(marker)})
    return rows


def rows_text(rows: list[dict], baseline: str | None, marker: str = "[DATA]") -> str:
    """Which runs wrote fewer data rows than the baseline and which wrote more, in words (from row_counts)."""
    column = f"{marker} rows written"
    counts = {row["configuration"]: row[column] for row in rows}
    if baseline not in counts:
        return "no plain greedy run is recorded to compare with"
    base = counts.pop(baseline)
    fewer = [name for name, n in counts.items() if n < base]
    more = [name for name, n in counts.items() if n > base]

    def span(names):
        low, high = min(counts[n] for n in names), max(counts[n] for n in names)
        return f"{low}" if low == high else f"{low}–{high}"

    parts = [f"plain greedy wrote {base} rows"]
    if fewer:
        parts.append(f"{', '.join(fewer)} fewer ({span(fewer)})")
    if more:
        parts.append(f"{', '.join(more)} more ({span(more)})")
    if not fewer and not more:
        parts.append("every speculative run as many")
    return "; ".join(parts)


def ends_text(baseline: dict | None, changed: dict[str, dict]) -> str:
    """Whether speculation moved where the completions end, in words: `changed` maps each configuration that
    wrote other tokens than plain greedy to its first repeat; `baseline` is plain greedy's first repeat."""
    if baseline is None or not changed:
        return "No speculative completion differs from plain greedy's, so nothing moved"
    moved = [name for name, repeat in changed.items()
             if (repeat["finish_reason"], repeat["output_tokens"]) != (baseline["finish_reason"], baseline["output_tokens"])]
    if moved:
        return (f"Where the completion ends moved for {', '.join(moved)}: a near-tie flipped early in the completion "
                "changes everything after it")
    return (f"Every changed completion ended where plain greedy's did ({outcome(baseline)}): speculation changed "
            "tokens, not where the completion stops")


def stops_text(margins: list[float], flagged: int, threshold: float) -> str:
    """The detector on the recorded stops, in words."""
    if not margins:
        return "No recorded run stopped before its token limit, so the detector had no stop to judge"
    return (f"The recorded stops won by {min(margins):.2f} to {max(margins):.2f} logits: {flagged} of {len(margins)} "
            f"are within the detector's threshold of {threshold:.3f} logits")


def upstream_text(changed: dict[str, dict], baseline: dict | None, divergence_at: str) -> str:
    """Where speculation changed the completion: at the stop, or upstream of it, in words."""
    if baseline is None or not changed:
        return "Speculation left every completion as plain greedy wrote it"
    stopped = [name for name, repeat in changed.items() if repeat["finish_reason"] == "stop"]
    text = (f"Where speculation changed the organism's completion, speculative and plain decoding first part at "
            f"output token {divergence_at} (below), at a near-tie of their own")
    if stopped or baseline["finish_reason"] == "stop":
        text += ", not at the stop: a tie-stop detector sees only the stop; the classifier finds the tie upstream"
    else:
        text += ("; no run stopped there, so there is no stop for a tie-stop detector to judge, and the classifier "
                 "is the tool that finds the tie")
    return text


MIN_FOR_RATE = 10  # fewer cases than this are counted, not turned into a rate


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def rate_text(part: int, whole: int) -> str:
    """'3 of 40 (8%)', or the counts alone when there are too few for a rate."""
    if whole >= MIN_FOR_RATE:
        return f"{part} of {whole} ({part / whole:.0%})"
    return f"{part} of {whole}" + (" (too few for a rate)" if whole else "")


def survey_verdict(counts: dict) -> str:
    """What the tie-stop survey says of the detector on this model, in words (from survey.tally)."""
    if not counts:
        return "No survey is recorded for this model"
    stops = plural(counts["ordinary_stops"], "ordinary stop")
    if not counts["ordinary_stops"]:
        verdict = ("No completion of the survey ended with an ordinary stop on this model, so the detector's "
                   "false-positive rate is not measured here")
    elif not counts["ordinary_flagged"]:
        verdict = f"On this model the detector flagged none of the {stops}"
    else:
        verdict = f"On this model the detector flagged {counts['ordinary_flagged']} of the {stops}"
    if 0 < counts["ordinary_stops"] < MIN_FOR_RATE:
        verdict += f" (fewer than {MIN_FOR_RATE}: too few to estimate a rate)"
    if counts["moved_tie_at_divergence"]:
        verdict += "; it is blind to ties upstream of the stop, and the classifier (below) is the tool for those"
    return verdict


def classifier_score_text(rows: list[dict]) -> str:
    """How the classifier did on the labelled cases, in words (rows from divergence.classify_cases)."""
    ties = [r for r in rows if r["truth"] == "near-tie"]
    bugs = [r for r in rows if r["truth"] == "bug"]
    text = (f"it called {sum(r['right'] for r in ties)} of {len(ties)} near-ties near-ties and caught "
            f"{sum(r['right'] for r in bugs)} of {len(bugs)} planted bugs")
    missed: dict[str, list[dict]] = {}
    for r in bugs:
        if not r["right"]:
            missed.setdefault(r["class"], []).append(r)
    if missed:
        worst = max(abs(r["fp32 margin"]) for group in missed.values() for r in group)
        text += (f"; it missed {', '.join(f'{name} ({len(group)})' for name, group in missed.items())}: in each, the "
                 f"planted bug first changed a token where fp32's top two were at most {worst:.3f} logits apart, "
                 f"and every later token stayed within the band, so the output is one a correct engine could write")
    wrong_ties = [r for r in ties if not r["right"]]
    if wrong_ties:
        text += f"; it called {len(wrong_ties)} near-tie(s) suspected bugs ({', '.join(r['case'] for r in wrong_ties)})"
    return text


def recorded_verdicts_text(rows: list[dict], widest_band: float) -> str:
    """The classifier on real engines' divergences (unlabelled), per speculative method, in words."""
    if not rows:
        return "no speculative run of this host parted from plain greedy"
    by_method: dict[str, list[dict]] = {}
    for r in rows:
        by_method.setdefault(r["class"], []).append(r)
    parts = []
    for method, group in by_method.items():
        bugs = [r for r in group if r["verdict"] == "bug"]
        part = f"{method}: {len(bugs)} of {len(group)} called suspected bugs"
        far = [r for r in bugs if abs(r["fp32 margin"]) > widest_band]
        if far:
            part += (f", {len(far)} of them at a first divergence whose two tokens fp32 puts "
                     f"{min(abs(r['fp32 margin']) for r in far):.1f} to {max(abs(r['fp32 margin']) for r in far):.1f} "
                     f"logits apart, beyond the widest band recorded ({widest_band:.2f})")
        parts.append(part)
    return "; ".join(parts)


def detector_text(rates: dict, curve: list[dict]) -> str:
    """The detector's measured error rates at one threshold (survey.detector_rates), and where along the curve
    (survey.detector_curve) it would start to catch truncations at confident positions, in words."""
    if "near-tie planted" not in rates:
        return "no injected truncations are recorded for this model, so the detector's recall is not measured here"
    text = (f"it caught {rate_text(rates['near-tie caught'], rates['near-tie planted'])} truncations planted at "
            f"near-ties and {rate_text(rates['confident caught'], rates['confident planted'])} planted at confident "
            "positions")
    if rates.get("ordinary_stops"):
        text += f", and flagged {rate_text(rates['ordinary_flagged'], rates['ordinary_stops'])} ordinary stops"
    else:
        text += "; no ordinary stop was recorded to count false positives on"
    first = next((r for r in curve if r["confident caught"]), None)
    if first is not None:
        text += (f". It would begin to flag truncations at confident positions only from a threshold of "
                 f"{first['threshold']:.2f} logits")
        if first.get("ordinary_stops"):
            text += f", where it would flag {rate_text(first['ordinary_flagged'], first['ordinary_stops'])} ordinary stops"
    if rates["near-tie caught"] > rates["confident caught"]:
        text += (". A tie-stop detector finds stops that a computation shape could flip; a stop forced where the "
                 "model wanted to go on looks like any other stop to it and shows only against plain greedy "
                 "(spectie classify)")
    return text


def class_counts(cases: list[dict]) -> str:
    """'designed tie: 8, digit tie: 8': how many labelled cases of each class, in the cases' order."""
    counts: dict[str, int] = {}
    for case in cases:
        counts[case["class"]] = counts.get(case["class"], 0) + 1
    return ", ".join(f"{name}: {count}" for name, count in counts.items())


# ------------------------------------------------------------------------------ the chapter's evidence, from records
def model_records(model: str, **match) -> list[dict]:
    """The records under results/ matching `match` that were made with the very weights `model` names here."""
    from spectie.records import load_records, same_weights

    return [r for r in load_records(**match) if same_weights(r, model)]


def recorded_runs(model: str, environment: str) -> list[dict]:
    """The recorded vLLM runs of `model`'s weights in `environment`: one matrix run on one prompt (this host's where
    it made one). A record of another organism is never re-scored with this one."""
    from spectie.reproduce import one_run

    return one_run(model_records(model, chapter="reproduce", kind="engine-outcome"), environment)


def gpu_runs(model: str) -> dict[str, list[dict]]:
    """The recorded vLLM runs of `model`'s weights on a GPU, every prompt, per environment (by vLLM release)."""
    from spectie.summary import gpu_matrix_runs

    runs = gpu_matrix_runs(model_records(model, chapter="reproduce", kind="engine-outcome"))
    return {environment: records for (environment, _), records in runs.items()}


def gpu_verdicts_text(runs: list[dict], rows: list[dict], band: float, band_origin: str, widest_band: float,
                      ledger: dict) -> str:
    """One GPU environment's divergences under the classifier, and the #39273 fixes the ledger finds in its
    release, in words."""
    from spectie.fixes import fixes_for

    fingerprint = runs[0]["fingerprint"]
    seeds = sorted({r["parameters"]["prompt_seed"] for r in runs})
    ledger_rows = [r for r in fixes_for(ledger, fingerprint["vllm"]) if r["fix"].startswith("39273")]
    return (f"vLLM {fingerprint['vllm']} on an {fingerprint['gpu']} ({runs[0]['environments'][0]}, {len(seeds)} "
            f"prompts): {plural(len(rows), 'divergence')} at the band of {band:.3f} logits ({band_origin}); "
            f"{recorded_verdicts_text(rows, widest_band)}. The fix ledger on this release for vLLM #39273 "
            "(ngram on GDN models corrupting state): "
            + (", ".join(f"{r['fix']}: {r['this release']}" for r in ledger_rows) or "not in the ledger"))


def incident_fp32(reported: list[dict]) -> dict:
    """The fp32 row of the incident's reported logit comparison at its stop (margin, winner)."""
    logits = next(r for r in reported if r["kind"] == "logit-comparison")
    return next(row for row in logits["results"]["rows"] if row["dtype"] in ("fp32", "float32"))


def incident_flag_text(reported: list[dict]) -> str:
    """Whether the detector would flag the incident's fp32 stop at the incident's own fp32-to-bf16 swing, in words."""
    swing, _ = tiestop.reported_swing(next(r for r in reported if r["kind"] == "logit-comparison"))
    if tiestop.is_near_tie(incident_fp32(reported)["margin"], swing):
        return (f"inside the incident's own fp32-to-bf16 swing of {swing:.2f} logits, the threshold the detector "
                "uses when no band is recorded for a model: it would flag it")
    return f"outside the incident's own fp32-to-bf16 swing of {swing:.2f} logits: the detector would not flag it"


def noise_band(model: str, threshold: float | None, detector: bool = False) -> tuple[float, str]:
    """A tool's threshold and where it comes from: `threshold` as given, else the bf16 band recorded for `model`'s
    weights (on this machine's device where one is): the classifier's; with `detector`, the larger of that band
    and one bf16 step at the logits recorded for these weights (the detector reads bf16-rounded margins)."""
    if threshold is not None:
        return threshold, "given as a parameter"
    from spectie.model import resolve_model

    find = tiestop.detector_threshold_for_model if detector else tiestop.threshold_for_model
    return find(resolve_model(model))


def baseline_run(runs: list[dict]) -> dict | None:
    """The run of the baseline configuration (plain greedy), or None."""
    return next((r for r in runs if r["parameters"]["configuration"] == r["parameters"]["baseline"]), None)


def first_repeats(runs: list[dict]) -> dict[str, dict]:
    """Each run's first repeat, by configuration (runs without a repeat left out)."""
    return {r["parameters"]["configuration"]: r["results"]["repeats"][0] for r in runs if r["results"]["repeats"]}


def speculative_runs(runs: list[dict]) -> list[dict]:
    """The runs other than the baseline that completed (status ok)."""
    baseline = baseline_run(runs)
    return [r for r in runs if r["results"]["status"] == "ok" and r is not baseline]


def changed_completions(runs: list[dict]) -> tuple[dict | None, dict[str, dict]]:
    """The baseline's first repeat (None without one), and the first repeat of each speculative run that wrote other
    tokens than it, by configuration."""
    baseline = baseline_run(runs)
    first = first_repeats(runs)
    base = first.get(baseline["parameters"]["configuration"]) if baseline else None
    if base is None:
        return None, {}
    changed = {}
    for r in speculative_runs(runs):
        name = r["parameters"]["configuration"]
        if first[name]["token_ids"] != base["token_ids"]:
            changed[name] = first[name]
    return base, changed


def run_facts(runs: list[dict]) -> dict:
    """The glue values that describe the recorded runs: what ran, what speculation changed, how the runs ended and
    whether their repeats agreed."""
    base, changed = changed_completions(runs)
    ran = speculative_runs(runs)
    first = first_repeats(runs)
    mtp = {r["parameters"]["num_speculative_tokens"]: first[r["parameters"]["configuration"]] for r in ran
           if r["parameters"]["method"] == "mtp"}
    distinct = max((r["results"]["distinct_outputs"] for r in runs if r["results"]["repeats"]), default=0)
    failed = [r for r in runs if r["results"]["status"] != "ok"]
    return {
        "vllm_version": runs[0]["fingerprint"]["vllm"] if runs else "—",
        "speculative_ran": len(ran),
        "speculative_changed": len(changed),
        "speculative_earlier": sum(1 for r in ran if base and stopped_earlier(r["results"]["repeats"][0], base)),
        "baseline_outcome": outcome(base) if base else "—",
        "changed_outcomes": grouped_outcomes(changed) or "none",
        "k_outcomes": grouped_outcomes({f"K = {k}": mtp[k] for k in sorted(mtp)}) or "no MTP run recorded",
        "distinct_max": distinct,
        "repeat_note": "every repeat identical" if distinct == 1
        else f"up to {distinct} distinct outputs per configuration",
        "determinism_text": "deterministic: every repeat wrote the same output" if distinct == 1
        else "not deterministic: repeats differ",
        "repeats_each": max((r["results"]["runs_total"] for r in runs), default=0),
        "failed_names": ", ".join(f"{r['parameters']['configuration']} ({r['results']['status']})" for r in failed)
        or "none",
        "ends_text": ends_text(base, changed),
        "batch_invariant_text": batch_invariant_text(runs, baseline_run(runs)),
    }


def detector_facts(rows: list[dict], threshold: float) -> dict:
    """The glue values of the tie-stop detector on the recorded stops (rows from detector_rows)."""
    stops = [r for r in rows if r["finish"] == "stop"]
    flagged = sum(1 for r in stops if r["flagged"])
    margins = [r["margin"] for r in stops if r["margin"] is not None and r["margin"] == r["margin"]]  # not NaN
    return {"stops_total": len(stops), "stops_flagged": flagged, "stops_text": stops_text(margins, flagged, threshold)}


def cached_classifier(model: str, threshold: float):
    """divergence.classify for `model` at `threshold` as a function of (prompt, a, b) that classifies each distinct
    divergence once: the chapter's tables and its verdict records read the same classification."""
    results: dict[tuple, divergence.Divergence] = {}

    def classify(prompt_ids: list[int], tokens_a: list[int], tokens_b: list[int]) -> divergence.Divergence:
        key = (tuple(prompt_ids), tuple(tokens_a), tuple(tokens_b))
        if key not in results:
            results[key] = divergence.classify(model, prompt_ids, tokens_a, tokens_b, threshold)
        return results[key]

    return classify


def classify_runs(runs: list[dict], classify) -> list[tuple[dict, divergence.Divergence]]:
    """(run, verdict) for every run whose first repeat diverged from its baseline's (speculative_divergences),
    `classify` taking (prompt, the run's tokens, the baseline's tokens)."""
    results = []
    for record, base in speculative_divergences(runs):
        pair = divergence.pair_from_records(record, base)
        results.append((record, classify(pair["prompt_token_ids"], pair["a"], pair["b"])))
    return results


def classifier_rows(results: list[tuple[dict, divergence.Divergence]], planted: divergence.Divergence) -> list[dict]:
    """The classifier table: a row per classified vLLM run (from classify_runs), then the planted bug's."""
    rows = [classifier_row(f"{r['parameters']['configuration']} vs {r['parameters']['baseline']} (vLLM)", result)
            for r, result in results]
    return rows + [classifier_row("planted lost GDN state vs plain (transformers)", planted)]


def divergence_positions(results: list[tuple[dict, divergence.Divergence]]) -> str:
    """The output tokens (counted from one) where the classified runs first part from their baseline: '12, 58', or
    '—' when none did."""
    positions = {None if result.position is None else result.position + 1 for _, result in results}
    return ", ".join(str(p) for p in sorted(positions)) or "—"


def classifier_facts(runs: list[dict], results: list[tuple[dict, divergence.Divergence]],
                     planted: divergence.Divergence) -> dict:
    """The glue values of the divergence classifier on the recorded runs (results from classify_runs) and on the
    planted bug."""
    suspected = [r["parameters"]["configuration"] for r, result in results
                 if result.verdict == divergence.SUSPECTED_BUG]
    base, changed = changed_completions(runs)
    positions = divergence_positions(results)
    return {
        "vllm_near_ties": sum(1 for _, result in results if result.verdict == divergence.NEAR_TIE),
        "vllm_divergences": len(results),
        "vllm_divergence_at": positions,
        "upstream_text": upstream_text(changed, base, positions),
        "suspected_note": "; it calls " + ", ".join(suspected) + " a suspected correctness bug (below)" if suspected
        else "; none is a suspected bug",
        "vllm_suspected": suspected_text(results),
        "planted_verdict": planted.verdict,
        "planted_explanation": planted.explanation,
    }


def decisive_facts(records: list[dict]) -> dict:
    """The glue values of fp32's margin and winner at the decisive position, from the first of the margins chapter's
    logit comparisons (`records`); nan and '—' without one."""
    if not records:
        return {"decisive_fp32": float("nan"), "decisive_winner": "—"}
    fp32 = {row["dtype"]: row for row in records[0]["results"]["rows"]}["fp32"]
    return {"decisive_fp32": fp32["margin"], "decisive_winner": fp32["winner"]}


def b200_facts(reported: list[dict]) -> dict:
    """The glue values of the incident's B200 runs by K (reported): at which K they stopped early, at which they went
    on, and whether that contradicts a K threshold."""
    b200 = [r for r in reported if r["id"].startswith("b200-k")]
    by_k = sorted((r["parameters"]["num_speculative_tokens"], r["results"]["stopped_early"]) for r in b200)
    stops_at = [k for k, stopped in by_k if stopped]
    goes_on = [k for k, stopped in by_k if not stopped]
    return {"b200_k_stops": ", ".join(map(str, stops_at)) or "—",
            "b200_k_continues": ", ".join(map(str, goes_on)) or "—",
            "k_threshold_text": "a wider K did not stop where a narrower one did, so no K threshold holds"
            if any(k > s for k in goes_on for s in stops_at) else "these runs alone do not contradict a K threshold"}


def guard_summary(record: dict) -> dict:
    """The guard's figures from its record (spectie.guard_measure): near-tie stops that reached the client without
    and with the guard, completions resumed, extra requests, and the guard's time per completion minus the
    server's alone (median and 95th percentile)."""
    import numpy as np

    rows = record["results"]["prompts"]
    added = [row["guarded"]["seconds"] - row["direct"]["seconds"] for row in rows]
    return {"prompts": len(rows),
            "near_tie_without": sum(row["direct"]["near_tie_stop"] for row in rows),
            "near_tie_with": sum(row["guarded"]["near_tie_stop"] for row in rows),
            "resumed": sum(row["guarded"]["resumed"] > 0 for row in rows),
            "extra_requests": sum(row["guarded"]["extra_requests"] for row in rows),
            "added_median_s": float(np.median(added)), "added_p95_s": float(np.percentile(added, 95)),
            "direct_median_s": float(np.median([row["direct"]["seconds"] for row in rows]))}


def guard_sentence(record: dict | None) -> str:
    """What the guard's record says, in words, with its figures (`guard_summary`); where none is recorded, that it
    was not run yet and what runs it."""
    if record is None:
        return ("The guard has not been measured on this model yet: `make build` measures it on this host "
                "(the guidance chapter's `guard_prompts`)")
    s = guard_summary(record)
    where = f"through vllm serve (vLLM {record['results']['vllm_version']}, {record['results']['backend']}) with MTP"
    reached = (f"{plural(s['near_tie_without'], 'completion')} of {s['prompts']} ended on a near-tie end-of-text stop "
               f"without the guard and {s['near_tie_with']} with it")
    if not s["resumed"]:
        return f"On the survey's prompts {where}, {reached}: the guard had nothing to resume and added no request"
    return (f"On the survey's prompts {where}, {reached}; the guard resumed {plural(s['resumed'], 'completion')} "
            f"with {plural(s['extra_requests'], 'extra request')}, and its time per completion minus the server's "
            f"alone was {s['added_median_s']:+.2f} s at the median and {s['added_p95_s']:+.2f} s at the 95th "
            f"percentile (a completion took {s['direct_median_s']:.2f} s without it, on this host)")
