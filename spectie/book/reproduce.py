"""Tables and texts of one reproduction run, built from engine-outcome records: the configurations it ran and how
they ended, where each parted from plain greedy and what it wrote there, the classifier's verdicts, the repeat grid,
and the reported and measured outcomes side by side. The page across prompts and hosts: spectie.book.reproduce_page.

Measured records come from spectie.engines.matrix_run (one per configuration, prompt seed and host); reported ones
from the incident. Nothing here runs an engine.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import matplotlib.pyplot as plt
import pandas as pd

from spectie.records.environments import load_environments, release
from spectie.book.incident import configuration_label, environment_label, outcome_label
from spectie.lab.bands import model_name
from spectie.records.record_types import EngineConfiguration, EngineOutcome, Record, Verdict
from spectie.records.completions import baseline_run, stop_moved, tokens_written
from spectie.engines.runner import root_cause

STATUS_COLOURS = {"unsupported": "#dddddd", "crashed": "#b0b0b0", "interrupted": "#eeeeee"}


def measured_runs(records: list[Record]) -> list[Record]:
    """The reproduction chapter's measured records, in matrix order (baseline first) per host."""
    runs = [r for r in records if r.measured and r.kind == "engine-outcome"]
    return sorted(runs, key=lambda r: (r.environment, r.fingerprint.host_id, r.parameters.matrix,
                                       r.parameters.configuration != r.parameters.baseline,
                                       r.started_at))


def where_label(record: Record) -> str:
    """The vLLM build and hardware of a measured run, e.g. 'vLLM 0.32.0 (cpu) · CPU'."""
    f = record.fingerprint
    return f"vLLM {f.vllm} ({f.vllm_platform}) · {record.device}"


def run_label(record: Record) -> str:
    """Where a measured run came from: environment, vLLM build, hardware, model (and the tensor-parallel split)."""
    split = record.parameters.ranks
    return (f"{record.environment} · {where_label(record)} · {model_name(record)}" +
            (f" · tensor_parallel_size {split}" if split > 1 else ""))


def measured_label(parameters: EngineConfiguration) -> str:
    label = configuration_label(parameters)
    if parameters.ranks > 1:
        label += f", tensor_parallel_size {parameters.ranks}"
    if parameters.enable_prefix_caching is False:
        label += ", no prefix caching"
    elif parameters.enable_prefix_caching is True:
        label += ", prefix caching"
    return label


UNKNOWN = "unknown"


def acceptance(repeats: list[dict]) -> float | str | None:
    """Share of drafted tokens that the target model accepted, over all repeats (None without drafts; UNKNOWN when
    vLLM's metrics could not be read for a repeat)."""
    if any("unreadable" in (r.get("speculation") or {}) for r in repeats):
        return UNKNOWN
    drafted = sum(r["speculation"].get("num_draft_tokens", 0) for r in repeats)
    accepted = sum(r["speculation"].get("num_accepted_tokens", 0) for r in repeats)
    return accepted / drafted if drafted else None


def status_label(results: EngineOutcome) -> str:
    if results.status in (None, "ok"):
        return outcome_label(results)
    return results.status


def runs_table(records: list[Record]) -> pd.DataFrame:
    """One row per measured configuration: what ran, what happened, how it compares with the baseline."""
    rows = []
    for r in measured_runs(records):
        p, res = r.parameters, r.results
        repeats = res.repeats
        same = [x["same_as_baseline"] for x in repeats if x["same_as_baseline"] is not None]
        divergences = [x["first_divergence"] for x in repeats if x["first_divergence"] is not None]
        rate = acceptance(repeats)
        runner = p.model_runner or "default"
        rows.append({
            "run": run_label(r),
            "configuration": p.configuration,
            "engine": measured_label(p),
            "model runner (asked → used)": f"{runner} → {res.model_runner_used or '—'}",
            "status": res.status,
            "outcome": status_label(res),
            "tokens written": ", ".join(sorted({str(tokens_written(x)) for x in repeats})) or "—",
            "distinct outputs": res.distinct_outputs if repeats else "—",
            "same as baseline": f"{sum(same)}/{len(same)}" if same else ("baseline" if
                                                                           p.configuration == p.baseline
                                                                           else "—"),
            "first divergence (output token)": 1 + min(divergences) if divergences else "—",
            "draft acceptance": rate if rate == UNKNOWN else f"{rate:.0%}" if rate is not None else "—",
            "error": (res.error or {}).get("type", ""),
            "record": r.id,
        })
    return pd.DataFrame(rows)


FRAME = re.compile(r'\s*File "(?P<path>[^"]+)", line \d+, in (?P<function>\S+)')


def error_lines(record: Record) -> str:
    """vLLM's own error for a configuration that did not run: its message, the innermost frame that raised it
    (named inside its package, not by this host's paths) and the root cause the engine's log names."""
    error = record.results.error
    if not error:
        return ""
    frames = [m for m in map(FRAME.match, error.get("traceback_tail") or []) if m]
    where = None
    if frames:
        path = frames[-1]["path"]
        where = f"raised in {path.split('site-packages/')[-1] if 'site-packages/' in path else Path(path).name}" \
                f" ({frames[-1]['function']})"
    cause = root_cause(error)
    message = re.sub(r"\s*\[type=[^\]]*\]", "", error["message"])  # pydantic's trailer: the repr of every argument
    return "\n".join([f"{error['type']} during {error['phase']}: {message[-400:]}",
                      *([where] if where else []), *([f"root cause (engine log): {cause}"] if cause else [])])


def side_by_side(reported: list[Record], measured: list[Record]) -> pd.DataFrame:
    """Reported (incident) and measured outcomes, one row per configuration and environment, labelled;
    measured rows are the runs of the incident's prompt (each host's first prompt seed). A measured run of a
    vLLM release the incident names sits directly under that release's last reported row; the others follow."""
    environments = load_environments()
    reported = [r for r in reported if r.kind == "engine-outcome"]
    every = measured_runs(measured)
    runs = measured_runs(first_prompt(measured))  # the incident's prompt; the others in the "all prompts" column
    released = [{release(environments[e]["vllm"].get("version")) for e in r.environments} for r in reported]
    last_of = {version: i for i, versions in enumerate(released) for version in versions if version}

    def under(m: Record) -> int | None:
        """The reported row a measured run goes under: the last of its release's, None if none."""
        return last_of.get(release(m.fingerprint.vllm))

    def measured_row(r: Record) -> dict:
        return {"provenance": "measured", "where": where_label(r), "model": model_name(r),
                "configuration": measured_label(r.parameters), "outcome": status_label(r.results),
                "all prompts": across_prompts(every, r), "record": r.id}

    rows = []
    for i, r in enumerate(reported):
        rows.append({"provenance": "reported", "where": environment_label(r.environments, environments),
                     "model": "Qwen3.5 (the incident's)", "configuration": configuration_label(r.parameters),
                     "outcome": outcome_label(r.results), "all prompts": "the incident's prompt only",
                     "record": r.id})
        rows += [measured_row(m) for m in runs if under(m) == i]
    rows += [measured_row(m) for m in runs if under(m) is None]
    return pd.DataFrame(rows)


def across_prompts(runs: list[Record], record: Record) -> str:
    """What one configuration did over every prompt seed of its run (the side-by-side table shows the first):
    on which seeds it stopped early, e.g. 'stopped on seeds 1, 5 of 8', or 'continued on all 8'."""
    same = [r for r in runs
            if run_key(r) == run_key(record) and r.parameters.configuration == record.parameters.configuration]
    stopped = sorted(prompt_seed(r) for r in same if r.results.stopped_early)
    failed = [r for r in same if r.results.status not in (None, "ok")]
    if failed:
        return f"{failed[0].results.status} on {len(failed)} of {len(same)}"
    if not stopped:
        return f"continued on all {len(same)}" if len(same) > 1 else "continued (one prompt)"
    return f"stopped on seed{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} of {len(same)}"


def style_outcomes(table: pd.DataFrame, column: str = "outcome"):
    def colour(cell: str) -> str:
        if str(cell).startswith("stopped"):
            return "background-color: #f4cccc"
        if cell == "continued":
            return "background-color: #d9ead3"
        if cell in STATUS_COLOURS:
            return f"background-color: {STATUS_COLOURS[cell]}"
        return ""
    return table.style.map(colour, subset=[column]).hide(axis="index")


GRID_CLASSES = {  # what a generation did against plain greedy's (first repeat, same prompt)
    "as plain greedy": "#e6e6e6",
    "stopped earlier than plain greedy": "#d62728",
    "stopped later than plain greedy": "#1f77b4",
    "ran on where plain greedy stopped": "#b6d7a8",
    "other tokens, same length": "#ffbf00",
    "no plain greedy to compare": "#ffffff",
}


def grid_class(repeat: dict, baseline: dict | None) -> str:
    """One generation against the baseline's first repeat: the same tokens, or where it ended instead."""
    if baseline is None:
        return "no plain greedy to compare"
    if repeat.get("same_as_baseline") or repeat["token_hash"] == baseline["token_hash"]:
        return "as plain greedy"
    return {"earlier": "stopped earlier than plain greedy", "only here": "stopped earlier than plain greedy",
            "later": "stopped later than plain greedy", "only in the baseline": "ran on where plain greedy stopped",
            "same": "other tokens, same length"}[stop_moved(repeat, baseline)]


def repeat_grid(records: list[Record], max_tokens: int, title: str, verdicts: dict[str, str] | None = None):
    """Configuration × repeat, each cell one generation: its output tokens, coloured by what it did against
    plain greedy's (a stop that plain greedy makes too is not a truncation); hatched: did not run. `verdicts`
    (`divergence.matrix_verdicts`): the classifier's word on a configuration that parts from plain greedy, beside its row;
    a suspected bug's cells are cross-hatched."""
    from matplotlib.patches import Patch

    verdicts = verdicts or {}
    runs = measured_runs(records)
    width = max([len(r.results.repeats) for r in runs] + [r.parameters.repeats for r in runs] + [1])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(runs) + 1.6))
    base = baseline_run(runs)
    baseline = base.results.repeats[0] if base and base.results.repeats else None
    seen = set()
    for row, r in enumerate(runs):
        repeats = r.results.repeats
        for col in range(r.parameters.repeats):
            if col < len(repeats):
                kind = grid_class(repeats[col], baseline)
                seen.add(kind)
                bug = kind != "as plain greedy" and verdicts.get(r.parameters.configuration) == Verdict.BUG.short
                ax.add_patch(plt.Rectangle((col, row), 1, 1, facecolor=GRID_CLASSES[kind], edgecolor="black",
                                           linewidth=0.5, hatch="xx" if bug else None))
                ax.text(col + 0.5, row + 0.5, str(tokens_written(repeats[col])), ha="center", va="center",
                        fontsize=7, color="white" if kind in ("stopped earlier than plain greedy",
                                                              "stopped later than plain greedy") else "black")
            else:
                status = r.results.status
                ax.add_patch(plt.Rectangle((col, row), 1, 1, facecolor=STATUS_COLOURS.get(status, "#eeeeee"),
                                           edgecolor="white", hatch="//"))
                if col == 0:
                    ax.text(0.1, row + 0.5, status, va="center", fontsize=7)
    for row, r in enumerate(runs):
        verdict = verdicts.get(r.parameters.configuration)
        if verdict:
            ax.text(width + 0.15, row + 0.5, verdict, va="center", fontsize=7,
                    color="#990000" if verdict == Verdict.BUG.short else "black")
    ax.set_xlim(0, width)
    ax.set_ylim(len(runs), 0)
    ax.set_yticks([i + 0.5 for i in range(len(runs))], [r.parameters.configuration for r in runs], fontsize=8)
    ax.set_xticks([i + 0.5 for i in range(width)], [str(i + 1) for i in range(width)], fontsize=8)
    ax.set_xlabel("repeat (the number: output tokens written, end-of-text not counted)")
    handles = [Patch(facecolor=GRID_CLASSES[k], edgecolor="black", label=k) for k in GRID_CLASSES if k in seen]
    if Verdict.BUG.short in verdicts.values():
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="xx", label="classifier: suspected bug"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01 + (0.12 if verdicts else 0), 1))
    ax.set_title(title)
    fig.tight_layout()
    plt.close(fig)
    return fig


CONTEXT_TOKENS = 6  # tokens shown before a divergence


def divergences(records: list[Record], baseline: str | None, pieces) -> list[dict]:
    """For each distinct output that differs from the baseline: the first differing token on each side, at
its 1-based output token.

    `pieces` turns token ids into the tokenizer's pieces (e.g. `tokenizer.convert_ids_to_tokens`).
    """
    base = next((r for r in records if r.parameters.configuration == baseline), None)
    if base is None or not base.results.repeats:
        return []
    reference = base.results.repeats[0]["token_ids"]
    rows = []
    for r in records:
        distinct = {x["token_hash"]: x for x in r.results.repeats if x["first_divergence"] is not None}
        for x in distinct.values():
            at = x["first_divergence"]
            ids = x["token_ids"]
            rows.append({"configuration": r.parameters.configuration, "output token": at + 1,
                         "context": " ".join(pieces(reference[max(0, at - CONTEXT_TOKENS):at])),
                         f"{baseline} wrote": " ".join(pieces(reference[at:at + 1])) or "(ended)",
                         "this wrote": " ".join(pieces(ids[at:at + 1])) or "(ended)",
                         "tokens written": tokens_written(x),
                         f"{baseline}: tokens written": tokens_written(base.results.repeats[0])})
    return rows


def parting_text(records: list[Record], baseline: str | None, decisive_output_token: int) -> str:
    """Where each speculative configuration that ran first parts from the baseline (first repeats), against
    the prompt's designed decision (1-based output token), in words."""
    base = next((r for r in records if r.parameters.configuration == baseline), None)
    if base is None or not base.results.repeats:
        return "no baseline ran, so nothing is compared with plain greedy"
    groups: dict[str, list[str]] = {}
    for r in records:
        if r is base or r.parameters.method == "none" or not r.results.repeats:
            continue
        index = r.results.repeats[0]["first_divergence"]
        if index is None:
            where = f"wrote the same tokens as {baseline}"
        elif index + 1 == decisive_output_token:
            where = f"part from {baseline} at the designed decision (output token {decisive_output_token})"
        else:
            side = "before" if index + 1 < decisive_output_token else "after"
            where = f"part from {baseline} {side} the designed decision, at output token {index + 1}"
        groups.setdefault(where, []).append(r.parameters.configuration)
    if not groups:
        return "no speculative configuration ran"
    return "; ".join(f"{', '.join(names)}: {where}" for where, names in groups.items())


def decision_text(records: list[Record], output_token: int, pieces) -> str:
    """What each configuration that ran wrote at the designed decision (1-based output token), with the top-2
    logprob margin vLLM reported there (first repeats), grouped, in words."""
    groups: dict[str, list[str]] = {}
    for r in records:
        if not r.results.repeats:
            continue
        repeat, index = r.results.repeats[0], output_token - 1
        if len(repeat["token_ids"]) <= index:
            continue
        margins = repeat.get("top2_margins") or []
        margin = f", by a top-2 logprob margin of {margins[index]:.3f}" if len(margins) > index else ""
        groups.setdefault(f"wrote {pieces([repeat['token_ids'][index]])[0]!r} there{margin}", []).append(
            r.parameters.configuration)
    if not groups:
        return "no run reached the designed decision"
    return "; ".join(f"{', '.join(names)} {what}" for what, names in groups.items())


# ------------------------------------------------------------------------------------ a run's prompts
def prompt_seed(record: Record) -> int:
    """The prompt seed of a run (records made before several prompts were run: the incident's, seed 0)."""
    seed = record.parameters.prompt_seed
    return 0 if seed is None else seed


class RunKey(NamedTuple):
    """Which matrix run a record belongs to."""
    environment: str
    host: str
    matrix: str
    model: str
    ranks: int  # tensor-parallel ranks of each engine
    prompts: int  # how many prompt seeds the run took


def run_key(record: Record) -> RunKey:
    p = record.parameters
    return RunKey(record.environment, record.fingerprint.host_id, p.matrix, p.model, p.ranks, p.prompt_seeds or 1)


def by_run_and_prompt(records: list[Record]) -> list[list[Record]]:
    """`records` grouped into one matrix run's configurations on one prompt seed each (what a sentence comparing
    speculative and plain decoding compares), in first-seen order."""
    groups: dict[tuple, list[Record]] = {}
    for r in records:
        groups.setdefault((run_key(r), r.parameters.prompt_seed), []).append(r)
    return list(groups.values())


def first_prompt(records: list[Record]) -> list[Record]:
    """The runs of each host's first prompt seed (the incident's prompt where it ran): one per configuration."""
    first: dict[RunKey, int] = {}
    for r in records:
        first[run_key(r)] = min(first.get(run_key(r), prompt_seed(r)), prompt_seed(r))
    return [r for r in records if prompt_seed(r) == first[run_key(r)]]
