"""The guidance chapter's measured sections: the tie-stop survey (ordinary prompts through this host's vLLM, plain
and speculative: the detector's false positives), the injected truncations (its recall), and the guard (spectie
guard) through vllm serve with MTP, without it and with it. Each measures only what its records lack.

    guidance_survey.check_arguments(...)                 # every measured section's parameters, before any engine
    guidance_survey.run_survey(page, prompts, ...)       # then its values: survey_values(page), and so on
"""

from __future__ import annotations

from spectie.engines import survey
from spectie.book.claims import Claim, covering
from spectie.book.guidance import MIN_FOR_RATE, Page, plural, rate_text
from spectie.records.record_types import Record
from spectie.records.store import load_records, provenance_line, same_weights, standing_first

NO_SURVEY = "No tie-stop survey is recorded for this model."


def check_arguments(survey_prompts: int, injection_tokens: int, guard_prompts: int, guard_tokens: int) -> None:
    """Every measured section's parameters, checked before any engine starts (UsageError)."""
    from spectie.engines import guard_measure

    if injection_tokens:
        survey.check_new_tokens(injection_tokens)
    if guard_prompts:
        guard_measure.check_arguments(guard_prompts, guard_tokens)


def run_survey(page: Page, prompts: int, configurations: list[str], max_tokens: int) -> None:
    """The tie-stop survey of `prompts` ordinary prompts through this environment's vLLM (what its records lack)."""
    from spectie.records.chapters import current_hash
    from spectie.lab.model import resolve_model

    survey.run(resolve_model(page.model), page.environment, prompts, configurations,
               content_hash=current_hash("guidance"), model_label=page.model, max_tokens=max_tokens)


def run_injection(page: Page, prompts: int, new_tokens: int) -> None:
    """End-of-text planted at every output position of `prompts` survey prompts (what its records lack)."""
    from spectie.records.chapters import current_hash
    from spectie.lab.model import resolve_model

    survey.inject(resolve_model(page.model), page.environment, prompts, new_tokens,
                  content_hash=current_hash("guidance"), model_label=page.model)


def run_guard(page: Page, prompts: int, new_tokens: int) -> None:
    """The survey's prompts through vllm serve (MTP), without and with the guard (what its records lack)."""
    from spectie.engines import guard_measure
    from spectie.records.chapters import current_hash
    from spectie.lab.model import resolve_model

    guard_measure.measure(resolve_model(page.model), page.environment, prompts, new_tokens,
                          content_hash=current_hash("guidance"), model_label=page.model)


def surveys(page: Page) -> list[Record]:
    """Every recorded tie-stop survey of these weights (every host's)."""
    return [r for r in load_records(chapter=survey.CHAPTER, kind="tiestop-survey") if same_weights(r, page.model)]


def survey_row(record: Record, threshold: float) -> dict:
    """One survey's column of the survey table: where it ran, and its counts at `threshold`."""
    counts = survey.tally(record, threshold)
    return {
        "environment": record.environment, "host": record.fingerprint.host_id,
        "vLLM": record.results.vllm_version, "prompts": record.parameters.prompts,
        "configurations": ", ".join(record.results.configurations), "completions": counts["completions"],
        "stops": counts["stops"], "ordinary stops": counts["ordinary_stops"],
        "ordinary flagged (false positives)": counts["ordinary_flagged"], "moved by speculation": counts["moved"],
        "moved stops": counts["moved_stops"], "moved flagged": counts["moved_flagged"],
        "moved with a tie where they parted": counts["moved_tie_at_divergence"],
        "smallest ordinary margin": counts["ordinary_margin_min"]}


def survey_stop_facts(records: list[Record]) -> dict:
    """How many completions the surveys in `records` made, and how many of them ended on a stop token."""
    completions = [c for r in records for _, _, c, _, _ in survey.classified(r)]
    return {"completions": len(completions), "stopped": sum(c["finish_reason"] == "stop" for c in completions)}


def survey_words(main: Record) -> str:
    return f"the survey of host {main.fingerprint.host_id} (vLLM {main.results.vllm_version}, {main.environment})"


def false_positive_facts(records: list[Record], threshold: float) -> dict:
    """How many ordinary stops (speculation left the completion as plain greedy wrote it) the surveys in `records`
    hold, and how many of them the detector flags at `threshold`."""
    counts = [survey.tally(r, threshold) for r in records]
    return {"stops": sum(c["ordinary_stops"] for c in counts), "flagged": sum(c["ordinary_flagged"] for c in counts)}


def false_positive_claim(main: Record | None, threshold: float) -> Claim | str:
    """The detector's false positives among the survey's ordinary stops, naming the survey."""
    if main is None:
        return "—"
    facts, words = false_positive_facts([main], threshold), survey_words(main)
    return Claim("survey_fp_text", f"{rate_text(facts['flagged'], facts['stops'])} ordinary stops in {words}",
                 covering([main], words, main.kind), "spectie.book.guidance_survey:false_positive_facts", facts,
                 {"threshold": threshold})


def survey_stops_claim(main: Record | None) -> Claim | str:
    """How many of the survey's completions ended on a stop token, naming the survey (its host and vLLM)."""
    if main is None:
        return "—"
    facts, words = survey_stop_facts([main]), survey_words(main)
    return Claim("survey_stops_text", f"in {words}, {facts['stopped']} of {facts['completions']} completions ended "
                 "with a stop token", covering([main], words, main.kind), "spectie.book.guidance_survey:survey_stop_facts",
                 facts)


def survey_values(page: Page) -> dict:
    """The glue values of the survey section: every survey's counts (a table), this host's survey in figures and
    words, and its stop margins (a figure)."""
    import pandas as pd

    from spectie.book import plots
    from spectie.book.incident import fp32_row

    recorded = surveys(page)
    main = survey.this_hosts(standing_first(recorded, page.environment), page.environment)
    counts = survey.tally(main, page.tie_threshold) if main else {}
    resolution, smallest = counts.get("margin_resolution"), counts.get("ordinary_margin_min")
    lengths = sorted({n for r in recorded for n in r.parameters.prompt_lengths})
    values = {f"survey_{name}": counts.get(name, "—") for name in (
        "completions", "stops", "ordinary_stops", "ordinary_flagged", "moved", "moved_stops", "moved_flagged",
        "moved_tie_at_divergence")}
    values.update({
        "survey_table": pd.DataFrame([survey_row(r, page.tie_threshold) for r in recorded])
        .set_index(["environment", "host"]).T.style.format(precision=3, na_rep="—") if recorded else NO_SURVEY,
        "survey_prompts_n": main.parameters.prompts if main else 0,
        "survey_vllm": main.results.vllm_version if main else "—",
        "survey_configs": ", ".join(c for c in main.results.configurations if c != main.parameters.baseline)
        if main else "—",
        "survey_environment": main.environment if main else "—",
        "survey_verdict": survey_verdict_claim(main, page.tie_threshold), "survey_stops_text": survey_stops_claim(main),
        "survey_fp_text": false_positive_claim(main, page.tie_threshold),
        "survey_resolution": f"{resolution:.3f}" if resolution is not None else "—",
        "survey_min_margin": f"{smallest:.2f}" if smallest is not None else "—",
        "survey_lengths": f"{lengths[0]} to {lengths[-1]}" if lengths else "—",
        "survey_provenance": provenance_line(recorded),
        "survey_figure": plots.stop_margins(
            survey.margins_by_kind(main), page.tie_threshold,
            {"incident's stop, fp32 (reported)": fp32_row(page.reported)["margin"],
             f"bf16 band, {page.largest['label']}": page.largest["band"]},
            f"Stop margins of the survey ({page.model}, vLLM {main.results.vllm_version}, "
            f"{main.environment})") if main else NO_SURVEY})
    return values


def injection_values(page: Page) -> dict:
    """The glue values of the injected truncations: the detector's rates at its threshold and at the incident's
    swing, over thresholds (a figure), and where the injections ran."""
    import numpy as np

    from spectie.book import plots
    from spectie.tools.thresholds import reported_swing

    main = survey.this_hosts(standing_first(surveys(page), page.environment), page.environment)
    injections = load_records(chapter=survey.CHAPTER, kind=survey.INJECTION_KIND)
    ours = [r for r in injections if same_weights(r, page.model)]
    injection = survey.this_hosts(standing_first(ours, page.environment), page.environment)
    swing, _ = reported_swing()
    thresholds = sorted({*np.geomspace(0.01, 30, 80).tolist(), page.tie_threshold, swing})
    curve = survey.detector_curve(main, injection, thresholds)
    return {
        "detector_text": detector_claim("detector_text", main, injection, page.tie_threshold, thresholds, curve),
        "detector_swing_text": detector_claim("detector_swing_text", main, injection, swing, thresholds, curve, True),
        "swing": swing,
        "injection_prompts": injection.parameters.prompts if injection else 0,
        "injection_tokens": injection.parameters.new_tokens if injection else 0,
        "injection_dtype": injection.parameters.dtype if injection else "—",
        "injection_host": f"{injection.environment}, host {injection.fingerprint.host_id}" if injection else "—",
        "detector_figure": plots.detector_curve(
            curve, {f"default with --model {page.model}": page.tie_threshold,
                    "default without --model (reported swing)": swing},
            f"The tie-stop detector over thresholds ({page.model})"),
        "detector_provenance": provenance_line([r for r in (main, injection) if r])}


def guard_values(page: Page) -> dict:
    """The glue values of the guard section: this host's guard survey in words, and where every one came from."""
    records = [r for r in load_records(chapter=survey.CHAPTER, kind="guard-survey") if same_weights(r, page.model)]
    return {"guard_text": guard_claim(survey.this_hosts(standing_first(records, page.environment), page.environment)),
            "guard_provenance": provenance_line(records) if records else "no record yet"}


def survey_verdict(counts: dict, words: str = "the survey") -> str:
    """What the tie-stop survey `words` names says of the detector on this model, in words (from survey.tally)."""
    if not counts:
        return "No survey is recorded for this model"
    stops = plural(counts["ordinary_stops"], "ordinary stop")
    if not counts["ordinary_stops"]:
        verdict = (f"No completion of {words} ended with an ordinary stop, so the detector's false-positive rate is "
                   "not measured there")
    elif not counts["ordinary_flagged"]:
        verdict = f"In {words}, the detector flagged none of the {stops}"
    else:
        verdict = f"In {words}, the detector flagged {counts['ordinary_flagged']} of the {stops}"
    if 0 < counts["ordinary_stops"] < MIN_FOR_RATE:
        verdict += f" (fewer than {MIN_FOR_RATE}: too few to estimate a rate)"
    if counts["moved_tie_at_divergence"]:
        verdict += "; it is blind to ties upstream of the stop, and the classifier (below) is the tool for those"
    return verdict


def verdict_facts(records: list[Record], threshold: float) -> dict:
    """The counts `survey_verdict` states, summed over the surveys in `records`."""
    counts = [survey.tally(r, threshold) for r in records]
    return {name: sum(c[name] for c in counts)
            for name in ("ordinary_stops", "ordinary_flagged", "moved_tie_at_divergence")}


def survey_verdict_claim(main: Record | None, threshold: float) -> Claim | str:
    """`survey_verdict` on this host's survey, as a claim naming it."""
    if main is None:
        return survey_verdict({})
    facts, words = verdict_facts([main], threshold), survey_words(main)
    return Claim("survey_verdict", survey_verdict(facts, words), covering([main], words, main.kind),
                 "spectie.book.guidance_survey:verdict_facts", facts, {"threshold": threshold})


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


def detector_facts(records: list[Record], threshold: float, thresholds: list[float] = ()) -> list[dict]:
    """Per injection record among `records`, with the survey of its host: the detector's counts at `threshold`,
    and the first of `thresholds` at which it catches a truncation planted at a confident position."""
    facts = []
    for injection in sorted((r for r in records if r.kind == survey.INJECTION_KIND), key=lambda r: r.id):
        host = injection.fingerprint.host_id
        main = next((r for r in records if r.kind == "tiestop-survey" and r.fingerprint.host_id == host), None)
        rates = survey.detector_rates(main, injection, threshold)
        curve = survey.detector_curve(main, injection, list(thresholds))
        facts.append({**{name: value for name, value in rates.items() if "caught" in name or "planted" in name
                         or name in ("ordinary_stops", "ordinary_flagged")},
                      "first_confident": next((r["threshold"] for r in curve if r["confident caught"]), None)})
    return facts


def detector_claim(name: str, main: Record | None, injection: Record | None, threshold: float,
                   thresholds: list[float], curve: list[dict], first_sentence: bool = False) -> Claim | str:
    """`detector_text` at `threshold` on this host's injections and survey (`curve`: survey.detector_curve over
    `thresholds`), as a claim naming them (`first_sentence`: its counts only)."""
    text = detector_text(survey.detector_rates(main, injection, threshold), curve)
    if injection is None:
        return text
    if first_sentence:
        text, thresholds = text.split(". ")[0], []
    words = f"the injections and survey of host {injection.fingerprint.host_id}"
    return Claim(name, f"on {words}, {text}", covering([r for r in (main, injection) if r], words, ""),
                 "spectie.book.guidance_survey:detector_facts", detector_facts([injection, *filter(None, [main])],
                                                                          threshold, thresholds),
                 {"threshold": threshold, "thresholds": thresholds})


def guard_summary(record: Record) -> dict:
    """The guard's figures from its record (spectie.engines.guard_measure): near-tie stops that reached the client without
    and with the guard, completions resumed, extra requests, and the guard's time per completion minus the
    server's alone (median and 95th percentile)."""
    import numpy as np

    rows = record.results.prompts
    added = [row["guarded"]["seconds"] - row["direct"]["seconds"] for row in rows]
    return {"prompts": len(rows),
            "near_tie_without": sum(row["direct"]["near_tie_stop"] for row in rows),
            "near_tie_with": sum(row["guarded"]["near_tie_stop"] for row in rows),
            "resumed": sum(row["guarded"]["resumed"] > 0 for row in rows),
            "extra_requests": sum(row["guarded"]["extra_requests"] for row in rows),
            "added_median_s": float(np.median(added)), "added_p95_s": float(np.percentile(added, 95)),
            "direct_median_s": float(np.median([row["direct"]["seconds"] for row in rows]))}


GUARD_FACTS = ("prompts", "near_tie_without", "near_tie_with", "resumed", "extra_requests")


def guard_scope(record: Record) -> str:
    """The runs a guard sentence covers, in words: the survey's prompts, the server and the host."""
    return (f"the survey's prompts through vllm serve (vLLM {record.results.vllm_version}, {record.results.backend}, "
            f"host {record.fingerprint.host_id}) with MTP")


def guard_facts(records: list[Record]) -> dict:
    """The guard's counts (`guard_summary`) summed over `records`: what `guard_sentence` states."""
    summaries = [guard_summary(r) for r in records]
    return {name: sum(s[name] for s in summaries) for name in GUARD_FACTS}


def guard_claim(record: Record | None) -> Claim | str:
    """`guard_sentence` as a claim over the guard survey it reads (its environment, host and weights)."""
    if record is None:
        return guard_sentence(None)
    return Claim("guard_text", guard_sentence(record), covering([record], guard_scope(record), record.kind),
                 "spectie.book.guidance_survey:guard_facts", guard_facts([record]))


def guard_sentence(record: Record | None) -> str:
    """What the guard's record says, in words, with its figures (`guard_summary`); where none is recorded, that it
    was not run yet and what runs it."""
    if record is None:
        return ("The guard has not been measured on this model yet: `make build` measures it on this host "
                "(the guidance chapter's `guard_prompts`)")
    s = guard_summary(record)
    reached = (f"{plural(s['near_tie_without'], 'completion')} of {s['prompts']} ended on a near-tie end-of-text stop "
               f"without the guard and {s['near_tie_with']} with it")
    if not s["resumed"]:
        return f"On {guard_scope(record)}, {reached}: the guard had nothing to resume and added no request"
    return (f"On {guard_scope(record)}, {reached}; the guard resumed {plural(s['resumed'], 'completion')} "
            f"with {plural(s['extra_requests'], 'extra request')}, and its time per completion minus the server's "
            f"alone was {s['added_median_s']:+.2f} s at the median and {s['added_p95_s']:+.2f} s at the 95th "
            f"percentile (a completion took {s['direct_median_s']:.2f} s without it, on this host)")



def probe_values() -> dict:
    """The glue values of the server-probe finding: every host's record of `vllm serve` on one- and two-token
    prompts (spectie.engines.serve_probe), in words."""
    from spectie.engines import serve_probe

    records = load_records(chapter=serve_probe.CHAPTER, kind=serve_probe.KIND)
    return {"probe_text": probe_sentence(records),
            "probe_provenance": provenance_line(records) if records else "no record yet"}


def probe_sentence(records: list[Record]) -> str:
    """Whether `vllm serve` survived a one-token prompt, per host that measured it; that it was not measured yet, and
    the command, where no host did."""
    from spectie.engines.serve_probe import COMMAND, died_on_one_token

    if not records:
        return (f"Whether vllm serve survives a one-token prompt has not been measured yet: {COMMAND} measures it "
                "on a host")
    said = []
    for record in sorted(records, key=lambda r: (r.fingerprint.cpu, r.fingerprint.host_id)):
        servers = record.results.servers
        died = [name for name in servers if died_on_one_token(record, name)]
        where = (f"on {record.fingerprint.gpu or record.fingerprint.cpu} (host {record.fingerprint.host_id}), vLLM "
                 f"{record.results.vllm_version} ({record.results.backend}) serving {record.parameters.model}")
        if not died:
            said.append(f"{where} answered prompts of one and two tokens ({', '.join(servers)})")
            continue
        one = servers[died[0]]["requests"][1]
        error = servers[died[0]]["log_error"]
        answered = [name for name in servers if name not in died]
        which = (f"every server: {', '.join(died)}" if not answered
                 else f"{', '.join(died)}; {', '.join(answered)} answered it")
        said.append(f"{where} answered two tokens, but a one-token prompt ended the server ({which}): HTTP "
                    f"{one['status'] or 'no answer'}, then no answer to any request"
                    + (f"; its log: {error.rstrip('.')}" if error else ""))
    return ("A one-token prompt is a hazard of the server, not of the guard, which never sends one of its own (its "
            "probe is two tokens): " + "; ".join(said) + f" ({COMMAND} re-runs it)")  # glued as text: no Markdown
