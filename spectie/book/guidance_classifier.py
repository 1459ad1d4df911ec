"""The guidance chapter's classifier sections: the divergence classifier (spectie.tools.divergence) on every recorded
speculative run that parted from plain greedy, on a planted state bug, on the labelled cases (truth known by
construction) and on each GPU environment's recorded divergences, whose verdicts it keeps as records (the book's
first page reads them).

    classify = guidance_classifier.cached_classifier(page.model, page.threshold)
    values = guidance_classifier.run_values(page, classify)           # this environment's runs and the planted bug
    values = guidance_classifier.cases_values(page, classify, ledger)  # labelled cases, GPU runs; writes verdicts
"""

from __future__ import annotations

from spectie.tools import divergence, divergence_cases, divergence_verdicts
from spectie.book.claims import Claim, covering
from spectie.book.guidance import Page, changed_completions, model_records, plural, upstream_text, yes_no
from spectie.records.record_types import Record


def speculative_divergences(records: list[Record]) -> list[tuple[Record, Record]]:
    """(record, its baseline) for every reproduction record whose first repeat diverged from the baseline."""
    by_name = {r.parameters.configuration: r for r in records}
    pairs = []
    for record in records:
        baseline = by_name.get(record.parameters.baseline)
        repeats = record.results.repeats
        if baseline is not None and baseline is not record and repeats and repeats[0].get("first_divergence") is not None:
            pairs.append((record, baseline))
    return pairs


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


def classify_runs(runs: list[Record], classify) -> list[tuple[Record, divergence.Divergence]]:
    """(run, verdict) for every run whose first repeat diverged from its baseline's (speculative_divergences),
    `classify` taking (prompt, the run's tokens, the baseline's tokens)."""
    results = []
    for record, base in speculative_divergences(runs):
        pair = divergence.pair_from_records(record, base)
        results.append((record, classify(pair["prompt_token_ids"], pair["a"], pair["b"])))
    return results


def planted_bug(model: str = "organism", prompt_tokens: int = 1845, seed: int = 0, new_tokens: int = 96,
                corrupt_at: int = 0) -> tuple[list[int], list[int], list[int]]:
    """The prompt, plain bf16 greedy output, and the output with GDN states lost from `corrupt_at` on."""
    from spectie.lab.model import greedy_generate, load_model, reference_gdn_kernels, resolve_model
    from spectie.lab.prompts import PromptSpec, build_prompt
    from spectie.lab.tokenizer import model_tokenizer

    path = resolve_model(model)
    tokenizer = model_tokenizer(path)
    prompt = list(build_prompt(PromptSpec(tokens=prompt_tokens, seed=seed), tokenizer).token_ids)
    eos = [tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    with reference_gdn_kernels():
        loaded = load_model(path, "bfloat16")
        plain = greedy_generate(loaded, prompt, new_tokens, eos).output_ids
        buggy = divergence_cases.greedy_with_bug(loaded, prompt, new_tokens, eos, "lost-state", corrupt_at)
    return prompt, plain, buggy


def classifier_row(name: str, result: divergence.Divergence) -> dict:
    return {"pair": name, "verdict": result.verdict.value,
            "first divergence (output token)": None if result.position is None else result.position + 1,
            "tokens (a / b)": f"{result.text_a!r} / {result.text_b!r}", "fp32 margin": result.reference_margin,
            "bf16 margin": result.serving_margin, "a outside the band": len(result.outside_band_a),
            "b outside the band": len(result.outside_band_b), "threshold": result.threshold}


def classifier_rows(results: list[tuple[Record, divergence.Divergence]], planted: divergence.Divergence) -> list[dict]:
    """The classifier table: a row per classified vLLM run (from classify_runs), then the planted bug's."""
    rows = [classifier_row(f"{r.parameters.configuration} vs {r.parameters.baseline} (vLLM)", result)
            for r, result in results]
    return rows + [classifier_row("planted lost GDN state vs plain (transformers)", planted)]


def divergence_positions(results: list[tuple[Record, divergence.Divergence]]) -> str:
    """The output tokens (counted from one) where the classified runs first part from their baseline: '12, 58', or
    '—' when none did."""
    positions = {None if result.position is None else result.position + 1 for _, result in results}
    return ", ".join(str(p) for p in sorted(positions)) or "—"


def suspected_text(results: list[tuple[Record, divergence.Divergence]]) -> str:
    """What the classifier found among recorded vLLM runs that is not a near-tie, in words (for the page)."""
    suspected = [(record, result) for record, result in results if result.verdict == divergence.Verdict.BUG]
    if not suspected:
        return "no divergence is a suspected bug: every one is a near-tie."
    parts = []
    for record, result in suspected:
        worst = max(result.outside_band_a, key=lambda t: t["gap"], default=None)
        parts.append(f"{record.parameters.configuration} ({len(result.outside_band_a)} tokens outside the band"
                     + (f", up to {worst['gap']:.1f} logits below the fp32 reference's choice" if worst else "") + ")")
    text = ("the classifier calls " + ", ".join(parts) + " a suspected correctness bug: numerics move a margin by "
            "tenths of a logit, not by several logits.")
    if any(record.parameters.method in ("ngram", "ngram_gpu") for record, _ in suspected):
        text += (" vLLM #39273 reports a bug of this class for ngram speculation on Qwen3.5 (a GDN state read from the "
                 "wrong slot after accepted drafts; reported, not verified here on Qwen3.5 weights): with ngram, check "
                 "that your vLLM carries its fixes before putting an early stop down to a tie.")
    return text


def classifier_facts(runs: list[Record], results: list[tuple[Record, divergence.Divergence]],
                     planted: divergence.Divergence) -> dict:
    """The glue values of the divergence classifier on the recorded runs (results from classify_runs) and on the
    planted bug."""
    suspected = [r.parameters.configuration for r, result in results
                 if result.verdict == divergence.Verdict.BUG]
    base, changed = changed_completions(runs)
    positions = divergence_positions(results)
    return {
        "vllm_near_ties": sum(1 for _, result in results if result.verdict == divergence.Verdict.NEAR_TIE),
        "vllm_divergences": len(results),
        "vllm_divergence_at": positions,
        "upstream_text": upstream_text(changed, base, positions, len(suspected)),
        "suspected_note": "; it calls " + ", ".join(suspected) + " a suspected correctness bug (below)" if suspected
        else "; none is a suspected bug",
        "vllm_suspected": suspected_text(results),
        "planted_verdict": planted.verdict.value,
        "planted_explanation": planted.explanation,
    }


def class_counts(cases: list[dict]) -> str:
    """'designed tie: 8, digit tie: 8': how many labelled cases of each class, in the cases' order."""
    counts: dict[str, int] = {}
    for case in cases:
        counts[case["class"]] = counts.get(case["class"], 0) + 1
    return ", ".join(f"{name}: {count}" for name, count in counts.items())


def classifier_score_text(rows: list[dict]) -> str:
    """How the classifier did on the labelled cases, in words (rows from divergence_cases.classify_cases)."""
    counts = divergence_verdicts.score_counts(rows)
    text = (f"it called {counts['near_ties_right']} of {counts['near_ties']} near-ties near-ties and caught "
            f"{counts['bugs_caught']} of {counts['bugs']} planted bugs")
    if counts["missed"]:
        worst = max(abs(r["fp32_margin"]) for r in rows if r["truth"] == "bug" and not r["right"])
        text += (f"; it missed {', '.join(f'{name} ({n})' for name, n in counts['missed'].items())}: in each, the "
                 f"planted bug first changed a token where fp32's top two were at most {worst:.3f} logits apart, "
                 f"and every later token stayed within the band, so the output is one a correct engine could write")
    wrong_ties = [r for r in rows if r["truth"] == "near-tie" and not r["right"]]
    if wrong_ties:
        text += f"; it called {len(wrong_ties)} near-tie(s) suspected bugs ({', '.join(r['case'] for r in wrong_ties)})"
    return text


def case_score_facts(records: list[Record]) -> list[dict]:
    """Per record of the classifier on the labelled cases among `records`: its `divergence_verdicts.score_counts`
    (what `classifier_score_text` states)."""
    return [divergence_verdicts.score_counts(r.results.rows)
            for r in sorted((r for r in records if r.kind == divergence_verdicts.CASES_KIND), key=lambda r: r.id)]


def classifier_score_claim(record: Record) -> Claim:
    """`classifier_score_text` on a record of the classifier's labelled cases, as a claim naming where they were
    scored."""
    words = f"the labelled cases as scored on host {record.fingerprint.host_id}"
    return Claim("classifier_score", f"on {words}, {classifier_score_text(record.results.rows)}",
                 covering([record], words, record.kind), "spectie.book.guidance_classifier:case_score_facts",
                 case_score_facts([record]))


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
        far = [r for r in bugs if abs(r["fp32_margin"]) > widest_band]
        if far:
            part += (f", {len(far)} of them at a first divergence whose two tokens fp32 puts "
                     f"{min(abs(r['fp32_margin']) for r in far):.1f} to {max(abs(r['fp32_margin']) for r in far):.1f} "
                     f"logits apart, beyond the widest band recorded ({widest_band:.2f})")
        parts.append(part)
    return "; ".join(parts)


def gpu_runs(model: str) -> dict[str, list[Record]]:
    """The recorded vLLM runs of `model`'s weights on a GPU, every prompt, per environment (by vLLM release)."""
    from spectie.book.release_findings import gpu_matrix_runs

    runs = gpu_matrix_runs(model_records(model, chapter="reproduce", kind="engine-outcome"))
    return {environment: records for (environment, _), records in runs.items()}


def gpu_verdicts_text(runs: list[Record], rows: list[dict], band: float, band_origin: str, widest_band: float,
                      ledger: dict) -> str:
    """One GPU environment's divergences under the classifier, and the #39273 fixes the ledger finds in its
    release, in words."""
    from spectie.tools.fixes import pull_requests_text

    fingerprint = runs[0].fingerprint
    seeds = sorted({r.parameters.prompt_seed for r in runs})
    return (f"vLLM {fingerprint.vllm} on an {fingerprint.gpu} ({runs[0].environment}, {len(seeds)} "
            f"prompts): {plural(len(rows), 'divergence')} at the band of {band:.3f} logits ({band_origin}); "
            f"{recorded_verdicts_text(rows, widest_band)}. The fix ledger on this release for vLLM #39273 "
            "(ngram on GDN models corrupting state), per pull request: " + pull_requests_text(ledger, fingerprint.vllm))



HEADERS = {"output_token": "output token", "fp32_margin": "fp32 margin"}  # a verdict row's fields, as a table heads them


def run_values(page: Page, classify) -> dict:
    """The glue values of the classifier on this environment's recorded runs and on a planted lost-state bug (its
    table, facts and sentences); `classify` from cached_classifier, so the verdict records reuse each classification."""
    import pandas as pd

    results = classify_runs(page.runs, classify)
    prompt, plain, buggy = planted_bug(page.model)
    planted = classify(prompt, buggy, plain)
    return {**classifier_facts(page.runs, results, planted),
            "classifier_table": pd.DataFrame(classifier_rows(results, planted)).style.format(precision=3, na_rep="—")
            .hide(axis="index")}


def cases_values(page: Page, classify, ledger: dict) -> dict:
    """The glue values of the classifier on the labelled cases (score, confusion table, case table) and on every GPU
    environment's recorded divergences of these weights (each at the band recorded on that GPU, where there is one);
    writes the verdicts on this environment's and each GPU environment's divergences as records."""
    import pandas as pd
    from IPython.display import Markdown

    from spectie.records.chapters import current_hash
    from spectie.records.fingerprint import now
    from spectie.lab.model import resolve_model
    from spectie.book.pages import bullets
    from spectie.tools.thresholds import threshold_for_model

    labelled = divergence_cases.read_cases()
    case_rows = divergence_cases.classify_cases(labelled["cases"], labelled["model"], page.threshold)
    cases = pd.DataFrame(case_rows).drop(columns=["threshold"]).rename(columns=HEADERS)
    values = {
        "confusion_table": divergence_cases.confusion(case_rows), "cases_n": len(case_rows),
        "tie_counts": class_counts([c for c in labelled["cases"] if c["label"] == divergence.Verdict.NEAR_TIE.label]),
        "digit_tie": divergence_cases.DIGIT_TIE, "corrupt_at": " and ".join(str(at + 1) for at in divergence_cases.CORRUPT_AT),
        "bug_prompts": len({tuple(c["prompt_token_ids"]) for c in labelled["cases"]
                            if c["label"] == divergence.Verdict.BUG.label}),
        "cases_threshold": page.threshold,
        "cases_table": cases.assign(right=cases["right"].map(yes_no)).style.format(precision=3).hide(axis="index")}
    started, content_hash = now(), current_hash("guidance")
    scores = divergence_verdicts.write_case_scores(case_rows, labelled["model"], page.threshold, page.origin,
                                                   page.environment, content_hash, started)
    values["classifier_score"] = classifier_score_claim(scores)
    here = divergence_cases.classify_cases(divergence_cases.recorded_pairs(page.runs), classifier=classify, progress=False)
    if here:
        divergence_verdicts.write_verdicts(here, page.runs, page.model, page.threshold, page.origin, page.environment,
                                  content_hash, started)
    texts, table = [], []
    for environment, records in gpu_runs(labelled["model"]).items():
        band, band_origin = threshold_for_model(resolve_model(labelled["model"]), device=records[0].fingerprint.gpu)
        rows = divergence_cases.classify_cases(divergence_cases.recorded_pairs(records), labelled["model"], band)
        if rows:
            divergence_verdicts.write_verdicts(rows, records, page.model, band, band_origin, page.environment, content_hash,
                                      started)
        texts.append(gpu_verdicts_text(records, rows, band, band_origin, page.largest["band"], ledger))
        table += [{"environment": environment, **row} for row in rows]
    none = "no GPU record of these weights"
    values["gpu_text"] = Markdown(bullets(texts)) if texts else none
    values["gpu_table"] = (pd.DataFrame(table).drop(columns=["truth", "right", "threshold"]).rename(columns=HEADERS).style
                           .format(precision=3).hide(axis="index") if table else none)
    return values
