"""The integrity check the guidance offers a caller: the data rows each recorded run wrote, against plain greedy's
(a listing that ends with fewer rows than its format expects was cut short, whichever decoding wrote it)."""

from __future__ import annotations

from spectie.records.completions import tokens_written
from spectie.records.record_types import Record


def row_counts(records: list[Record], model_path: str, marker: str = "[DATA]") -> list[dict]:
    """The integrity check a caller can make: data rows in each run's output (first repeat)."""
    from spectie.lab.tokenizer import model_tokenizer

    tokenizer = model_tokenizer(model_path)
    rows = []
    for record in records:
        if record.results.repeats:
            repeat = record.results.repeats[0]
            text = tokenizer.decode(repeat["token_ids"])
            rows.append({"configuration": record.parameters.configuration, "finish": repeat["finish_reason"],
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


def rows_facts(runs: list[Record], model: str) -> dict:
    """Over every matrix run and prompt seed in `runs`: how many data rows plain greedy wrote, and which
    speculative configurations wrote fewer or more (first repeats): what `rows_claim` states."""
    from spectie.lab.model import resolve_model
    from spectie.book.reproduce import by_run_and_prompt

    base_rows, fewer, more = set(), set(), set()
    for group in by_run_and_prompt(runs):
        counts = {row["configuration"]: row["[DATA] rows written"] for row in row_counts(group, resolve_model(model))}
        if group[0].parameters.baseline not in counts:  # no plain greedy run to compare with
            continue
        base = counts.pop(group[0].parameters.baseline)
        base_rows.add(base)
        fewer |= {name for name, n in counts.items() if n < base}
        more |= {name for name, n in counts.items() if n > base}
    return {"baseline_rows": sorted(base_rows), "fewer": sorted(fewer), "more": sorted(more)}
