"""Tables and figures of the reproduction chapter, built from engine-outcome records.

Measured records come from spectie.engines.runner (one per configuration and host); reported ones from the
incident. Nothing here runs an engine.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from spectie import qwen_shapes
from spectie.environments import load_environments, release
from spectie.incident import configuration_label, environment_label, outcome_label
from spectie.records import model_name
from spectie.engines.runner import root_cause, stopped_earlier, tokens_written

STATUS_COLOURS = {"unsupported": "#dddddd", "crashed": "#b0b0b0", "interrupted": "#eeeeee"}


def measured_runs(records: list[dict]) -> list[dict]:
    """The reproduction chapter's measured records, in matrix order (baseline first) per host."""
    runs = [r for r in records if r["provenance"] == "measured" and r["kind"] == "engine-outcome"]
    return sorted(runs, key=lambda r: (r["environments"][0], r["fingerprint"]["host_id"], r["parameters"]["matrix"],
                                       r["parameters"]["configuration"] != r["parameters"]["baseline"],
                                       r["started_at"]))


def where_label(record: dict) -> str:
    """The vLLM build and hardware of a measured run, e.g. 'vLLM 0.32.0 (cpu) · CPU'."""
    f = record["fingerprint"]
    return f"vLLM {f['vllm']} ({f.get('vllm_platform')}) · {f.get('gpu') or 'CPU'}"


def run_label(record: dict) -> str:
    """Where a measured run came from: environment, vLLM build, hardware, model."""
    return f"{record['environments'][0]} · {where_label(record)} · {model_name(record)}"


def measured_label(parameters: dict) -> str:
    label = configuration_label(parameters)
    if parameters.get("enable_prefix_caching") is False:
        label += ", no prefix caching"
    elif parameters.get("enable_prefix_caching") is True:
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


def status_label(results: dict) -> str:
    if results.get("status", "ok") == "ok":
        return outcome_label(results)
    return results["status"]


def runs_table(records: list[dict]) -> pd.DataFrame:
    """One row per measured configuration: what ran, what happened, how it compares with the baseline."""
    rows = []
    for r in measured_runs(records):
        p, res = r["parameters"], r["results"]
        repeats = res["repeats"]
        same = [x["same_as_baseline"] for x in repeats if x["same_as_baseline"] is not None]
        divergences = [x["first_divergence"] for x in repeats if x["first_divergence"] is not None]
        rate = acceptance(repeats)
        runner = p.get("model_runner") or "default"
        rows.append({
            "run": run_label(r),
            "configuration": p["configuration"],
            "engine": measured_label(p),
            "model runner (asked → used)": f"{runner} → {res.get('model_runner_used') or '—'}",
            "status": res["status"],
            "outcome": status_label(res),
            "tokens written": ", ".join(sorted({str(tokens_written(x)) for x in repeats})) or "—",
            "distinct outputs": res["distinct_outputs"] if repeats else "—",
            "same as baseline": f"{sum(same)}/{len(same)}" if same else ("baseline" if
                                                                           p["configuration"] == p["baseline"]
                                                                           else "—"),
            "first divergence (output token)": 1 + min(divergences) if divergences else "—",
            "draft acceptance": rate if rate == UNKNOWN else f"{rate:.0%}" if rate is not None else "—",
            "error": (res.get("error") or {}).get("type", ""),
            "record": r["id"],
        })
    return pd.DataFrame(rows)


FRAME = re.compile(r'\s*File "(?P<path>[^"]+)", line \d+, in (?P<function>\S+)')


def error_lines(record: dict) -> str:
    """vLLM's own error for a configuration that did not run: its message, the innermost frame that raised it
    (named inside its package, not by this host's paths) and the root cause the engine's log names."""
    error = record["results"].get("error")
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


def side_by_side(reported: list[dict], measured: list[dict]) -> pd.DataFrame:
    """Reported (incident) and measured outcomes, one row per configuration and environment, labelled;
    measured rows are the runs of the incident's prompt (each host's first prompt seed). A measured run of a
    vLLM release the incident names sits directly under that release's last reported row; the others follow."""
    environments = load_environments()
    reported = [r for r in reported if r["kind"] == "engine-outcome"]
    runs = measured_runs(first_prompt(measured))  # the incident's prompt; other prompts: seeds_rows
    released = [{release(environments[e]["vllm"].get("version")) for e in r["environments"]} for r in reported]
    last_of = {version: i for i, versions in enumerate(released) for version in versions if version}

    def under(m: dict) -> int | None:
        """The reported row a measured run goes under: the last of its release's, None if none."""
        return last_of.get(release(m["fingerprint"].get("vllm")))

    def measured_row(r: dict) -> dict:
        return {"provenance": "measured", "where": where_label(r), "model": model_name(r),
                "configuration": measured_label(r["parameters"]), "outcome": status_label(r["results"]),
                "record": r["id"]}

    rows = []
    for i, r in enumerate(reported):
        rows.append({"provenance": "reported", "where": environment_label(r["environments"], environments),
                     "model": "Qwen3.5 (the incident's)", "configuration": configuration_label(r["parameters"]),
                     "outcome": outcome_label(r["results"]), "record": r["id"]})
        rows += [measured_row(m) for m in runs if under(m) == i]
    rows += [measured_row(m) for m in runs if under(m) is None]
    return pd.DataFrame(rows)


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
    stopped, base_stopped = repeat["finish_reason"] == "stop", baseline["finish_reason"] == "stop"
    if stopped_earlier(repeat, baseline):
        return "stopped earlier than plain greedy"
    if stopped and tokens_written(repeat) > tokens_written(baseline):
        return "stopped later than plain greedy"
    if not stopped and base_stopped:
        return "ran on where plain greedy stopped"
    return "other tokens, same length"


def divergence_verdicts(records: list[dict], threshold: float | None = None) -> dict[str, str]:
    """The classifier's verdict on each configuration whose first repeat parts from plain greedy's (same prompt, the
    records' own model): its id -> "near-tie" or "suspected bug" (spectie.divergence, fp32 reference)."""
    from spectie import divergence

    base = next((r for r in records if r["parameters"]["configuration"] == r["parameters"]["baseline"]
                 and r["results"]["repeats"]), None)
    verdicts = {}
    for r in records:
        repeats = r["results"]["repeats"]
        if base is None or r is base or not repeats or repeats[0].get("first_divergence") is None:
            continue
        pair = divergence.pair_from_records(r, base)
        result = divergence.classify(r["parameters"]["model"], pair["prompt_token_ids"], pair["a"], pair["b"], threshold)
        verdicts[r["parameters"]["configuration"]] = ("near-tie" if result.verdict == divergence.NEAR_TIE
                                                      else "suspected bug")
    return verdicts


def repeat_grid(records: list[dict], max_tokens: int, title: str, verdicts: dict[str, str] | None = None):
    """Configuration × repeat, each cell one generation: its output tokens, coloured by what it did against
    plain greedy's (a stop that plain greedy makes too is not a truncation); hatched: did not run. `verdicts`
    (divergence_verdicts): the classifier's word on a configuration that parts from plain greedy, beside its row;
    a suspected bug's cells are cross-hatched."""
    from matplotlib.patches import Patch

    verdicts = verdicts or {}
    runs = measured_runs(records)
    width = max([len(r["results"]["repeats"]) for r in runs] + [r["parameters"]["repeats"] for r in runs] + [1])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(runs) + 1.6))
    base = next((r for r in runs if r["parameters"]["configuration"] == r["parameters"]["baseline"]), None)
    baseline = base["results"]["repeats"][0] if base and base["results"]["repeats"] else None
    seen = set()
    for row, r in enumerate(runs):
        repeats = r["results"]["repeats"]
        for col in range(r["parameters"]["repeats"]):
            if col < len(repeats):
                kind = grid_class(repeats[col], baseline)
                seen.add(kind)
                bug = kind != "as plain greedy" and verdicts.get(r["parameters"]["configuration"]) == "suspected bug"
                ax.add_patch(plt.Rectangle((col, row), 1, 1, facecolor=GRID_CLASSES[kind], edgecolor="black",
                                           linewidth=0.5, hatch="xx" if bug else None))
                ax.text(col + 0.5, row + 0.5, str(tokens_written(repeats[col])), ha="center", va="center",
                        fontsize=7, color="white" if kind in ("stopped earlier than plain greedy",
                                                              "stopped later than plain greedy") else "black")
            else:
                status = r["results"]["status"]
                ax.add_patch(plt.Rectangle((col, row), 1, 1, facecolor=STATUS_COLOURS.get(status, "#eeeeee"),
                                           edgecolor="white", hatch="//"))
                if col == 0:
                    ax.text(0.1, row + 0.5, status, va="center", fontsize=7)
    for row, r in enumerate(runs):
        verdict = verdicts.get(r["parameters"]["configuration"])
        if verdict:
            ax.text(width + 0.15, row + 0.5, verdict, va="center", fontsize=7,
                    color="#990000" if verdict == "suspected bug" else "black")
    ax.set_xlim(0, width)
    ax.set_ylim(len(runs), 0)
    ax.set_yticks([i + 0.5 for i in range(len(runs))], [r["parameters"]["configuration"] for r in runs], fontsize=8)
    ax.set_xticks([i + 0.5 for i in range(width)], [str(i + 1) for i in range(width)], fontsize=8)
    ax.set_xlabel("repeat (the number: output tokens written, end-of-text not counted)")
    handles = [Patch(facecolor=GRID_CLASSES[k], edgecolor="black", label=k) for k in GRID_CLASSES if k in seen]
    if "suspected bug" in verdicts.values():
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="xx", label="classifier: suspected bug"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01 + (0.12 if verdicts else 0), 1))
    ax.set_title(title)
    fig.tight_layout()
    plt.close(fig)
    return fig


CONTEXT_TOKENS = 6  # tokens shown before a divergence


def divergences(records: list[dict], baseline: str | None, pieces) -> list[dict]:
    """For each distinct output that differs from the baseline: the first differing token on each side, at
its 1-based output token.

    `pieces` turns token ids into the tokenizer's pieces (e.g. `tokenizer.convert_ids_to_tokens`).
    """
    base = next((r for r in records if r["parameters"]["configuration"] == baseline), None)
    if base is None or not base["results"]["repeats"]:
        return []
    reference = base["results"]["repeats"][0]["token_ids"]
    rows = []
    for r in records:
        distinct = {x["token_hash"]: x for x in r["results"]["repeats"] if x["first_divergence"] is not None}
        for x in distinct.values():
            at = x["first_divergence"]
            ids = x["token_ids"]
            rows.append({"configuration": r["parameters"]["configuration"], "output token": at + 1,
                         "context": " ".join(pieces(reference[max(0, at - CONTEXT_TOKENS):at])),
                         f"{baseline} wrote": " ".join(pieces(reference[at:at + 1])) or "(ended)",
                         "this wrote": " ".join(pieces(ids[at:at + 1])) or "(ended)",
                         "tokens written": tokens_written(x),
                         f"{baseline}: tokens written": tokens_written(base["results"]["repeats"][0])})
    return rows


def parting_text(records: list[dict], baseline: str | None, decisive_output_token: int) -> str:
    """Where each speculative configuration that ran first parts from the baseline (first repeats), against
    the prompt's designed decision (1-based output token), in words."""
    base = next((r for r in records if r["parameters"]["configuration"] == baseline), None)
    if base is None or not base["results"]["repeats"]:
        return "no baseline ran, so nothing is compared with plain greedy"
    groups: dict[str, list[str]] = {}
    for r in records:
        if r is base or r["parameters"]["method"] == "none" or not r["results"]["repeats"]:
            continue
        index = r["results"]["repeats"][0]["first_divergence"]
        if index is None:
            where = f"wrote the same tokens as {baseline}"
        elif index + 1 == decisive_output_token:
            where = f"part from {baseline} at the designed decision (output token {decisive_output_token})"
        else:
            side = "before" if index + 1 < decisive_output_token else "after"
            where = f"part from {baseline} {side} the designed decision, at output token {index + 1}"
        groups.setdefault(where, []).append(r["parameters"]["configuration"])
    if not groups:
        return "no speculative configuration ran"
    return "; ".join(f"{', '.join(names)}: {where}" for where, names in groups.items())


def decision_text(records: list[dict], output_token: int, pieces) -> str:
    """What each configuration that ran wrote at the designed decision (1-based output token), with the top-2
    logprob margin vLLM reported there (first repeats), grouped, in words."""
    groups: dict[str, list[str]] = {}
    for r in records:
        if not r["results"]["repeats"]:
            continue
        repeat, index = r["results"]["repeats"][0], output_token - 1
        if len(repeat["token_ids"]) <= index:
            continue
        margins = repeat.get("top2_margins") or []
        margin = f", by a top-2 logprob margin of {margins[index]:.3f}" if len(margins) > index else ""
        groups.setdefault(f"wrote {pieces([repeat['token_ids'][index]])[0]!r} there{margin}", []).append(
            r["parameters"]["configuration"])
    if not groups:
        return "no run reached the designed decision"
    return "; ".join(f"{', '.join(names)} {what}" for what, names in groups.items())


# ------------------------------------------------------------------------------------ across prompts
def prompt_seed(record: dict) -> int:
    """The prompt seed of a run (records made before several prompts were run: the incident's, seed 0)."""
    return record["parameters"].get("prompt_seed", 0)


def run_key(record: dict) -> tuple:
    """Which matrix run a record belongs to: environment, host, matrix, model."""
    return (record["environments"][0], record["fingerprint"]["host_id"], record["parameters"]["matrix"],
            record["parameters"]["model"])


def first_prompt(records: list[dict]) -> list[dict]:
    """The runs of each host's first prompt seed (the incident's prompt where it ran): one per configuration."""
    first: dict[tuple, int] = {}
    for r in records:
        first[run_key(r)] = min(first.get(run_key(r), prompt_seed(r)), prompt_seed(r))
    return [r for r in records if prompt_seed(r) == first[run_key(r)]]


def _stop(results: dict) -> int | None:
    """Output tokens of the first repeat if it stopped with EOS, else None (ran to max_tokens)."""
    repeat = results["repeats"][0]
    return repeat["output_tokens"] if repeat["finish_reason"] == "stop" else None


def first_parting(record: dict) -> int | None:
    """The first output token (1-based) where any repeat of a run parts from the baseline, None if none does."""
    at = [x["first_divergence"] for x in record["results"]["repeats"] if x["first_divergence"] is not None]
    return min(at) + 1 if at else None


def seeds_rows(records: list[dict], baseline: str | None) -> list[dict]:
    """Per configuration, over every prompt seed it ran on: how often its output parts from the baseline's
    (any repeat), where (1-based output tokens), and how its stop compares with the baseline's (first repeats)."""
    base = {prompt_seed(r): r["results"] for r in records
            if r["parameters"]["configuration"] == baseline and r["results"]["repeats"]}
    by_config: dict[str, list[dict]] = {}
    for r in records:
        by_config.setdefault(r["parameters"]["configuration"], []).append(r)
    rows = []
    for config, runs in by_config.items():
        ran = sorted((r for r in runs if r["results"]["repeats"] and prompt_seed(r) in base), key=prompt_seed)
        parted, stops = [], {"same": 0, "earlier": 0, "later": 0, "only here": 0, "only in the baseline": 0}
        for r in ran:
            at = first_parting(r)
            if at is not None:
                parted.append(at)
            here, there = _stop(r["results"]), _stop(base[prompt_seed(r)])
            if here is None and there is None or here == there:
                stops["same"] += 1
            elif there is None:
                stops["only here"] += 1
            elif here is None:
                stops["only in the baseline"] += 1
            else:
                stops["earlier" if here < there else "later"] += 1
        rows.append({
            "configuration": config,
            "status": ", ".join(sorted({r["results"]["status"] for r in runs})),
            "prompts": len(ran),
            "stopped early (first repeat)": f"{sum(_stop(r['results']) is not None for r in ran)}/{len(ran)}",
            "parts from the baseline": "baseline" if config == baseline else f"{len(parted)}/{len(ran)}",
            "where (output token)": ", ".join(str(p) for p in sorted(parted)) or "—",
            "stop moved": "—" if config == baseline else
            ", ".join(f"{n} {what}" for what, n in stops.items() if n and what != "same") or "never",
        })
    return rows


def parting_plot(records: list[dict], baseline: str | None, decisive_output_token: int | None, title: str):
    """Where each configuration first parts from the baseline, one dot per prompt: the first output token
    (any repeat) that differs; a hollow dot at the right edge where every repeat wrote the baseline's tokens
    to the end. A dashed line marks the designed decision, where the model has one."""
    base = {prompt_seed(r) for r in records if r["parameters"]["configuration"] == baseline and r["results"]["repeats"]}
    configs: dict[str, list[dict]] = {}
    for r in sorted(records, key=lambda r: r["parameters"]["configuration"]):
        if r["parameters"]["configuration"] != baseline:
            configs.setdefault(r["parameters"]["configuration"], []).append(r)
    longest = max((x["output_tokens"] for r in records for x in r["results"]["repeats"]), default=1)
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(configs) + 1.4))
    for row, (name, runs) in enumerate(configs.items()):
        ran = [r for r in runs if r["results"]["repeats"] and prompt_seed(r) in base]
        parted = [at for at in map(first_parting, ran) if at is not None]
        ax.scatter(parted, [row] * len(parted), color="#c0392b", s=22, zorder=3,
                   label="parts from the baseline here (one prompt)" if row == 0 else None)
        same = len(ran) - len(parted)
        if same:
            ax.scatter([longest], [row], facecolor="white", edgecolor="#2e7d32", s=40, zorder=3)
            ax.annotate(f"{same}× same to the end", (longest, row), xytext=(6, -3), textcoords="offset points", fontsize=7)
        if not ran:
            ax.text(1, row, "no generation recorded (" + ", ".join(sorted({r["results"]["status"] for r in runs})) + ")",
                    va="center", fontsize=7, color="#666666")
    if decisive_output_token is not None:
        ax.axvline(decisive_output_token, color="black", linestyle="--", linewidth=0.8, label="designed decision")
    ax.set_yticks(range(len(configs)), list(configs), fontsize=8)
    ax.set_ylim(len(configs) - 0.5, -0.5)
    ax.set_xlim(0, longest * 1.25)
    ax.set_xlabel(f"output token where the configuration first parts from {baseline} (hollow: never, through "
                  f"{longest} tokens)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never over a dot
    fig.tight_layout()
    plt.close(fig)
    return fig


def seeds_text(records: list[dict], baseline: str | None, decisive_output_token: int | None) -> str:
    """The across-prompts finding in words: how many speculative configurations part from the baseline
    on how many prompts, where (against the designed decision, if the model has one: None for random
    weights), whether any stop moved, and how the configurations without speculation fared."""
    methods = {r["parameters"]["configuration"]: r["parameters"].get("method") for r in records}
    rows = [r for r in seeds_rows(records, baseline) if r["configuration"] != baseline and r["prompts"]]
    plain_rows = [r for r in rows if methods.get(r["configuration"]) == "none"]
    rows = [r for r in rows if methods.get(r["configuration"]) != "none"]
    seeds = sorted({prompt_seed(r) for r in records})
    if not rows:
        text = f"no speculative configuration ran on the {len(seeds)} prompt{'s' if len(seeds) != 1 else ''}"
    else:
        parted = [r for r in rows if not r["parts from the baseline"].startswith("0/")]
        where = sorted({int(p) for r in parted for p in r["where (output token)"].split(", ")})
        moved = [r for r in rows if r["stop moved"] != "never"]
        text = (f"{len(rows)} speculative configuration{'s' if len(rows) != 1 else ''} ran on {len(seeds)} "
                f"prompt{'s' if len(seeds) != 1 else ''}; "
                f"{len(parted)} of them wrote something other than {baseline} on at least one prompt")
        if where:
            text += f", first parting at output token{'s' if len(where) > 1 else ''} {', '.join(map(str, where))}"
            if decisive_output_token is not None:
                at_decision = decisive_output_token in where
                text += (f" ({'including' if at_decision else 'never at'} the designed decision, output token "
                         f"{decisive_output_token})")
        text += "; " + (f"the stop moved for {len(moved)} of them "
                        f"({'; '.join(r['configuration'] + ': ' + r['stop moved'] for r in moved)})"
                        if moved else f"no configuration stopped anywhere other than where {baseline} did")
    for r in plain_rows:
        where = r["where (output token)"]
        text += (f"; without speculation, {r['configuration']} parts from {baseline} on {r['parts from the baseline']}"
                 f" prompts" + (f" (first at output token{'s' if ',' in where else ''} {where})" if where != "—" else ""))
    return text


def by_run(records: list[dict]) -> dict[str, list[dict]]:
    """Measured runs grouped by where they came from (environment, vLLM build, hardware, model)."""
    groups: dict[str, list[dict]] = {}
    for r in measured_runs(records):
        groups.setdefault(run_label(r), []).append(r)
    return groups


def run_summary(records: list[dict], decisive_output_token: int, pieces) -> str:
    """One host's recorded run in words: configurations grouped by status (with the generations recorded of
    those asked for), the engines' own errors, prompts, what the incident's prompt got at the designed
    decision, and across prompts."""
    configs: dict[str, list[dict]] = {}
    for r in records:
        configs.setdefault(r["parameters"]["configuration"], []).append(r)
    groups: dict[str, list[str]] = {}
    partial = False  # some configuration recorded fewer generations than asked
    for name, runs in configs.items():
        recorded = sum(r["results"]["runs_total"] for r in runs)
        asked = sum(r["parameters"]["repeats"] for r in runs)
        statuses = ", ".join(sorted({r["results"]["status"] for r in runs}))
        partial = partial or recorded != asked
        groups.setdefault(statuses, []).append(name if recorded == asked else f"{name} ({recorded} of {asked})")
    causes: dict[str, tuple[str, list[str]]] = {}  # kind of error (numbers aside) -> its first text, configurations
    for name, runs in configs.items():
        for error in (r["results"]["error"] for r in runs if r["results"].get("error")):
            cause = root_cause(error) or f"{error['type']}: {error['message'][-200:]}"
            _, names = causes.setdefault(re.sub(r"\d+(?:\.\d+)?", "#", cause), (cause, []))
            if name not in names:
                names.append(name)
    baseline = records[0]["parameters"]["baseline"]
    seeds = sorted({prompt_seed(r) for r in records})
    text = (f"{len(configs)} configuration{'s' if len(configs) != 1 else ''} recorded on {len(seeds)} "
            f"prompt{'s' if len(seeds) != 1 else ''} (seeds {', '.join(map(str, seeds))}). "
            + " ".join(f"{status.capitalize()}: {', '.join(names)}." for status, names in groups.items()))
    if partial:
        text += " (A name with a count recorded only that many of its generations.)"
    unexpected = [f"{name} (expected {runs[0]['results']['expected']})" for name, runs in configs.items()
                  if any(r["results"].get("as_expected") is False and r["results"]["status"] != "interrupted"
                         for r in runs)]  # an interrupted run is unfinished, not a surprise
    if unexpected:
        text += f" Not as the matrix expected: {', '.join(unexpected)}."
    for cause, names in causes.values():
        text += f" The engine's own error of {', '.join(names)}: \"{cause}\"."
    if qwen_shapes.is_random_weight_run(records[0]):
        asked = sorted({r["parameters"]["max_tokens"] for r in records})
        text += (" Random weights: the prompt's designed decision means nothing to this model, and every "
                 "generation was asked for " + " or ".join(map(str, asked)) + " tokens"
                 + (" whatever the model wrote (ignore_eos)" if all(r["parameters"].get("ignore_eos") for r in records)
                    else "") + ".")
        return f"{text} Across prompts: {seeds_text(records, baseline, None)}."
    return (f"{text} At the designed decision (output token {decisive_output_token}) of the first prompt: "
            f"{decision_text(first_prompt(records), decisive_output_token, pieces)}. Across prompts: "
            f"{seeds_text(records, baseline, decisive_output_token)}.")


def one_run(records: list[dict], environment: str) -> list[dict]:
    """The runs of one matrix run in `environment`, on its first prompt: this host's if it made any (what
    the build just ran), else the first recorded host's. Runs of several hosts or prompts are never mixed."""
    from spectie.fingerprint import host_id

    mine = [r for r in records if r["environments"][0] == environment]
    hosts = sorted({r["fingerprint"]["host_id"] for r in mine}, key=lambda h: h != host_id())
    return first_prompt([r for r in mine if hosts and r["fingerprint"]["host_id"] == hosts[0]])
