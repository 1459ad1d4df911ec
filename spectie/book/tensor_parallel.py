"""One engine on one device against the same engine split over several (tensor_parallel_size): the reproduce
chapter's comparison, from engine-outcome records of the same matrix, model, configurations and prompts.

A split engine ends every row-parallel layer with an all-reduce, an order of sums that one device never has. For each
configuration and prompt this says whether the split engine wrote the same tokens, where the two first part and by
what top-2 margin vLLM served there on each side, and whether the stop moved, both against each other and against
plain greedy at the same split. Nothing here runs an engine (spectie.engines.matrix_run does).
"""

from __future__ import annotations

import statistics

from spectie.records.completions import first_divergence, stopped_earlier, tokens_written
from spectie.records.record_types import Record
from spectie.book.reproduce import run_key

RUN_FILES = ("environments/runs/cpu-reproduce-8-seeds.yaml", "environments/runs/cpu-reproduce-tp2.yaml")


def _unsplit(record: Record) -> tuple:
    """The record's run, configuration and prompt, its split aside: what a split record is paired by."""
    return run_key(record)._replace(ranks=1), record.parameters.configuration, record.parameters.prompt_seed


def pairs(records: list[Record]) -> list[tuple[Record, Record]]:
    """(one device, split) records of the same environment, host, matrix, model, prompt set, configuration and
    prompt, where both wrote something; in configuration and prompt order."""
    ran = [r for r in records if r.kind == "engine-outcome" and r.measured and r.results.repeats]
    single = {_unsplit(r): r for r in ran if r.parameters.ranks == 1}
    found = [(single[_unsplit(r)], r) for r in ran if r.parameters.ranks > 1 and _unsplit(r) in single]
    return sorted(found, key=lambda pair: (pair[1].parameters.configuration != pair[1].parameters.baseline,
                                           pair[1].parameters.configuration, pair[1].parameters.prompt_seed))


def _ending(repeat: dict) -> str:
    return f"{'stop' if repeat['finish_reason'] == 'stop' else 'limit'} after {tokens_written(repeat)}"


def _margin(repeat: dict, index: int | None) -> float | None:
    """vLLM's top-2 logprob margin at an output token, where it was recorded."""
    margins = repeat.get("top2_margins") or []
    return margins[index] if index is not None and index < len(margins) else None


def _earlier_than_plain(record: Record, baselines: dict) -> str:
    base = baselines.get((run_key(record), record.parameters.prompt_seed))
    if base is None or record.is_baseline:
        return "—"
    return "yes" if stopped_earlier(record.results.repeats[0], base) else "no"


def margin_shifts(records: list[Record]) -> list[float]:
    """How far the split moved vLLM's top-2 logprob margin, at every output token where both sides had written the
    same tokens before it (first repeats): the split's own rounding, read where it has not yet changed a token."""
    shifts = []
    for one, split in pairs(records):
        a, b = one.results.repeats[0], split.results.repeats[0]
        at = first_divergence(b["token_ids"], a["token_ids"])
        same = len(a["token_ids"]) if at is None else at + 1  # at the parting token the context is still the same
        here, there = (a.get("top2_margins") or [])[:same], (b.get("top2_margins") or [])[:same]
        shifts += [abs(x - y) for x, y in zip(here, there)]
    return shifts


def rows(records: list[Record]) -> list[dict]:
    """One row per configuration and prompt run both ways (first repeats)."""
    baselines = {(run_key(r), r.parameters.prompt_seed): r.results.repeats[0] for r in records
                 if r.kind == "engine-outcome" and r.measured and r.results.repeats
                 and r.is_baseline}
    table = []
    for one, split in pairs(records):
        a, b = one.results.repeats[0], split.results.repeats[0]
        at = first_divergence(b["token_ids"], a["token_ids"])
        table.append({
            "environment": split.environment, "model": split.parameters.model,
            "configuration": split.parameters.configuration, "prompt seed": split.parameters.prompt_seed,
            "tensor parallel": f"1 / {split.parameters.ranks}", "same tokens": "yes" if at is None else "no",
            "first parting (output token)": "—" if at is None else at + 1,
            "top-2 margin there, 1": _margin(a, at), "top-2 margin there, split": _margin(b, at),
            "ending (1 / split)": f"{_ending(a)} / {_ending(b)}",
            "stop moved": "no" if _ending(a) == _ending(b) else "yes",
            "stopped earlier than plain (1 / split)": f"{_earlier_than_plain(one, baselines)} / "
                                                      f"{_earlier_than_plain(split, baselines)}"})
    return table


def summary_text(table: list[dict], decision: int | None = None, seed: int = 0, shifts: list[float] = ()) -> str:
    """The comparison in words, from `rows` and `margin_shifts`; `decision`: the designed decision (1-based output
    token) of prompt `seed`, where the organism's designed end-of-text/DATA tie is."""
    if not table:
        return ("not run yet: no split engine is recorded beside the same run on one device (" +
                "; ".join(f"`make run CHAPTER=reproduce PARAMS={path} ENV=cpu`" for path in RUN_FILES) + ")")
    runs = len(table)
    parted = [row for row in table if row["same tokens"] == "no"]
    moved = [row for row in table if row["stop moved"] == "yes"]
    text = (f"split over {table[0]['tensor parallel'].split(' / ')[1]} ranks, the engine wrote the same tokens as on "
            f"one in {runs - len(parted)} of {runs} runs ({len({r['configuration'] for r in table})} configurations × "
            f"{len({r['prompt seed'] for r in table})} prompts, first repeats)")
    text += _partings(parted) + _shifts(shifts) + _designed_tie(table, decision, seed)
    text += ("; no stop moved" if not moved else f"; the stop moved in {len(moved)} of the {runs} runs (" + ", ".join(
        f"{r['configuration']} on prompt {r['prompt seed']}: {r['ending (1 / split)']}" for r in moved) + ")")
    return text + _earlier_than_plain_text(table)


def _partings(parted: list[dict]) -> str:
    if not parted:
        return ""
    at = sorted(r["first parting (output token)"] for r in parted)
    margins = [[m for m in (r["top-2 margin there, 1"], r["top-2 margin there, split"]) if m is not None]
               for r in parted]
    smallest, largest = [min(pair) for pair in margins if pair], [max(pair) for pair in margins if pair]
    text = f"; the other {len(parted)} first part at output tokens {at[0]} to {at[-1]}"
    if smallest and max(smallest) == 0:
        return text + (", each at an exact tie in vLLM's logprobs on one side (top-2 margin 0), the other side's "
                       f"margin at most {max(largest):.3f} logits")
    if smallest:
        return text + (f", where vLLM's top-2 logprob margin was at most {max(smallest):.3f} logits on one side "
                       f"({smallest.count(0)} of them exactly 0) and at most {max(largest):.3f} on either")
    return text


def _shifts(shifts: list[float]) -> str:
    if not shifts:
        return ""
    shifted = [shift for shift in shifts if shift > 0]
    return (f"; where both had written the same tokens, the split moved vLLM's top-2 margin at {len(shifted)} of "
            f"{len(shifts)} output tokens" + (f", by at most {max(shifted):.3f} logits (median of those moved "
                                              f"{statistics.median(shifted):.3f})" if shifted else ""))


def _designed_tie(table: list[dict], decision: int | None, seed: int) -> str:
    mine = [r for r in table if r["prompt seed"] == seed]
    if decision is None or not mine:
        return ""
    early = [r["configuration"] for r in mine
             if r["same tokens"] == "no" and r["first parting (output token)"] <= decision]
    return f"; on prompt {seed} (the incident's layout) " + (
        f"{', '.join(early)} part at or before the designed decision (output token {decision})" if early else
        f"every configuration wrote the same tokens split and unsplit through the designed decision (output token "
        f"{decision}): the designed tie did not move")


def _earlier_than_plain_text(table: list[dict]) -> str:
    earlier = [{(r["configuration"], r["prompt seed"]) for r in table
                if r["stopped earlier than plain (1 / split)"].split(" / ")[side] == "yes"} for side in (0, 1)]
    text = (f"; speculation stopped earlier than plain greedy in {len(earlier[0])} runs on one device and "
            f"{len(earlier[1])} split")
    if earlier[0] != earlier[1]:
        def named(runs):
            return ", ".join(f"{c} on prompt {s}" for c, s in sorted(runs)) or "none"
        return (text + f" (only on one device: {named(earlier[0] - earlier[1])}; "
                       f"only split: {named(earlier[1] - earlier[0])})")
    return text + (" (the same runs)" if earlier[0] else "")


def page_values(records: list[Record], decision: int | None = None, seed: int = 0) -> dict:
    """The reproduce chapter's tensor-parallel section: the comparison in words, its table and where it came from."""
    import pandas as pd
    from IPython.display import Markdown

    from spectie.book.pages import capitalised, folded
    from spectie.records.store import provenance_line

    table = rows(records)
    shown = (folded(pd.DataFrame(table).style.hide(axis="index").format(precision=3, na_rep="—"),
                    "Per configuration and prompt, one process against a split engine (table)") if table
             else "No split engine is recorded yet.")
    text = summary_text(table, decision, seed, margin_shifts(records))
    return {"tp_summary": capitalised(text), "tp_table": shown,
            "tp_provenance": Markdown(provenance_line([r for pair in pairs(records) for r in pair]))}
