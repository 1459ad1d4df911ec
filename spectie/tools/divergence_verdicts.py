"""The classifier's verdicts on the divergences a vLLM environment wrote, kept as measured records (the guidance
chapter writes them; the first page reads them instead of classifying again). A recomputation that gives the same
verdicts, fp32 margins equal within MARGIN_TOLERANCE, leaves the earlier record as it was."""

from __future__ import annotations

from spectie.records.record_types import Record, VerdictParameters

VERDICTS_KIND = "divergence-verdicts"


def write_verdicts(rows: list[dict], engine_records: list[Record], model: str, threshold: float, origin: str,
                   environment: str, content_hash: str, started_at: str) -> Record:
    """A measured record of the classifier's verdicts on the divergences a vLLM environment wrote (the
    rows of `classify_cases` on its `recorded_pairs`): computed on this host, about the engine outputs of
    `engine_records`' environment, with the band used. The summary reads it instead of classifying again."""
    from spectie.records.fingerprint import host_id
    from spectie.records.store import measured_record

    source = engine_records[0]
    parameters = {"model": model, "engine_environment": source.environment,
                  "engine_vllm": source.fingerprint.vllm, "engine_device": source.device,
                  "threshold": threshold, "threshold_origin": origin}
    verdicts = [{k: v for k, v in row.items() if k not in ("truth", "right")} for row in rows]
    record = measured_record(
        record_id=f"{VERDICTS_KIND}-{source.environment}-{host_id()}".lower(), kind=VERDICTS_KIND,
        chapter="guidance", environment=environment, parameters=parameters,
        title=f"Classifier verdicts on vLLM {parameters['engine_vllm']}'s divergences ({parameters['engine_environment']})",
        results={"rows": verdicts}, started_at=started_at, content_hash=content_hash, dtype="float32")
    return kept_or_written(record)


def kept_or_written(record: dict) -> Record:
    """The record written, unless its path already holds the same verdicts on the same divergences with the same
    band: that one stands, unchanged."""
    from spectie.records.store import kept_on_this_device, measured_path, read_record, write_record

    path = measured_path(record)
    earlier = kept_on_this_device(path, lambda r: r.parameters == VerdictParameters.from_dict(record["parameters"])
                                  and same_rows(r.results.rows, record["results"]["rows"]))
    return earlier or read_record(write_record(record, path))


MARGIN_TOLERANCE = 1e-4  # logits: fp32 margins move in the 6th decimal with the CPU thread count, nothing else does


def same_rows(earlier: list[dict], now: list[dict]) -> bool:
    """The same verdict rows, fp32 margins equal within MARGIN_TOLERANCE (a recomputation on another number of
    threads sums in another order; the verdicts and every other field must be identical)."""
    def close(a, b) -> bool:
        return a == b or (isinstance(a, float) and isinstance(b, float) and abs(a - b) <= MARGIN_TOLERANCE)

    return len(earlier) == len(now) and all(
        row.keys() == other.keys() and all(close(row[k], other[k]) if k == "fp32_margin" else row[k] == other[k]
                                           for k in row) for row, other in zip(earlier, now))


CASES_KIND = "classifier-cases"


def write_case_scores(rows: list[dict], model: str, threshold: float, origin: str, environment: str,
                      content_hash: str, started_at: str) -> Record:
    """A measured record of the classifier on the labelled cases (sources/classifier_cases.json: truth known by
    construction), one row per case with its class, truth, verdict and whether it was right; what the first page
    says of the classifier's blind spots. An unchanged recomputation leaves the earlier record as it was."""
    from spectie.records.fingerprint import host_id
    from spectie.records.store import measured_record

    parameters = {"model": model, "threshold": threshold, "threshold_origin": origin}
    record = measured_record(
        record_id=f"{CASES_KIND}-{environment}-{host_id()}".lower(), kind=CASES_KIND, chapter="guidance",
        environment=environment, parameters=parameters, results={"rows": rows}, started_at=started_at,
        title="The divergence classifier on labelled cases (near-ties and planted bugs, built on the organism)",
        content_hash=content_hash, dtype="float32")
    return kept_or_written(record)


def score_counts(rows: list[dict]) -> dict:
    """How the classifier did on labelled cases (rows from divergence_cases.classify_cases): near-ties called
    right, planted bugs caught, and the bugs missed per class (in the rows' order)."""
    ties, bugs = ([r for r in rows if r["truth"] == truth] for truth in ("near-tie", "bug"))
    missed: dict[str, int] = {}
    for r in bugs:
        if not r["right"]:
            missed[r["class"]] = missed.get(r["class"], 0) + 1
    return {"near_ties": len(ties), "near_ties_right": sum(r["right"] for r in ties), "bugs": len(bugs),
            "bugs_caught": sum(r["right"] for r in bugs), "missed": missed}


def blind_spot(records: list[Record]) -> str:
    """The planted bug classes the classifier missed on its labelled cases, as a caveat; "" where none is recorded
    or it missed none. Read from this project's case records: the one of the host where it caught fewest (each host
    scores the cases at its own noise band), said as such where several hosts scored them."""
    cases = [r for r in records if r.kind == CASES_KIND]
    if not cases:
        return ""
    record = min(cases, key=lambda r: (score_counts(r.results.rows)["bugs_caught"], r.id))
    scored = score_counts(record.results.rows)
    if not scored["missed"]:
        return ""
    bugs = [row for row in record.results.rows if row["truth"] == "bug"]
    counts = ", ".join(f"{name} ({scored['missed'][name]} of {sum(r['class'] == name for r in bugs)})"
                       for name in sorted(scored["missed"]))
    where = (f" as scored on host {record.fingerprint.host_id}, the fewest of the {len(cases)} hosts that scored "
             f"them" if len(cases) > 1 else "")
    return (f"the classifier caught {scored['bugs_caught']} of {scored['bugs']} planted bugs on its labelled "
            f"cases{where}; it missed planted bugs of {counts}: a near-tie verdict does not rule out a bug of "
            f"{'those classes' if len(scored['missed']) > 1 else 'that class'} (measured on the organism, record `{record.id}`)")
