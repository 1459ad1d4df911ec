"""The first page's findings: per vLLM release run on a GPU here and decoding path (plain greedy, MTP, ngram_gpu),
what the records show, as a table and as one verdict per speculative path. Every cell and clause is computed from
the reproduce matrix's records and the classifier's verdict records, over the scope it names (FINDINGS_SCOPE).

    glue_all(findings.page_values(load_records()))       # findings_table, findings_scope, path_verdicts
"""

from __future__ import annotations

from spectie.book.claims import Claim, Scope
from spectie.book.pages import and_list, bullets
from spectie.records.record_types import Record
from spectie.book.release_findings import gpu_matrix_runs


PATHS = (("none", "plain greedy"), ("mtp", "MTP"), ("ngram_gpu", "ngram_gpu"))
FINDINGS_SCOPE = ("every vLLM run of the reproduce matrix on a GPU here, on the organism: every prompt seed and "
                  "every repeat, each speculative generation against plain greedy's on the same prompt")


def classified_cases(records: list[Record]) -> dict[tuple[str, str], dict]:
    """The classifier's verdict rows by (engine environment, case: "<configuration> vs <baseline>, seed <n>")."""
    from spectie.tools.divergence_verdicts import VERDICTS_KIND

    return {(r.parameters.engine_environment, row["case"]): row
            for r in records if r.kind == VERDICTS_KIND for row in r.results.rows}


def early_stop_facts(runs: list[Record], baselines: dict, cases: dict, env_id: str) -> list[dict]:
    """Per run of a path that stopped earlier than plain greedy: where (configuration, prompt seed, tokens written),
    how often, the stop's margin in vLLM's own logprobs, and what its tokens before the stop were: plain greedy's
    ("same"), or parted earlier at a divergence the classifier calls a near-tie ("near-tie") or a suspected bug
    ("bug") on the run's first repeat, or not classified yet ("unclassified")."""
    from spectie.records.completions import stopped_earlier, tokens_before_stop
    from spectie.records.record_types import Verdict

    facts = []
    for r in sorted(runs, key=lambda r: (r.parameters.configuration, r.parameters.prompt_seed)):
        seed, repeats = r.parameters.prompt_seed, r.results.repeats
        early = [x for x in repeats if seed in baselines and stopped_earlier(x, baselines[seed])]
        if not early:
            continue
        written = sorted({tokens_before_stop(x) for x in early})
        case = cases.get((env_id, f"{r.parameters.configuration} vs {r.parameters.baseline}, seed {seed}"))
        if all(x.get("first_divergence") is None or x["first_divergence"] >= written[0] for x in early):
            before, part_at = "same", None
        elif case and case["output_token"] < written[0]:
            before = "near-tie" if case["verdict"] == Verdict.NEAR_TIE.label else "bug"
            part_at = case["output_token"]
        else:
            before, part_at = "unclassified", None
        facts.append({"configuration": r.parameters.configuration, "seed": seed, "early": len(early),
                      "repeats": len(repeats), "written": written, "before": before, "part_at": part_at,
                      "margins": sorted({x["stop_margin"]["margin"] for x in early if x.get("stop_margin")})})
    return facts


def _stop_text(fact: dict) -> str:
    return (f"{fact['configuration']}, seed {fact['seed']}: {fact['early']} of {fact['repeats']} repeats, after "
            f"{' or '.join(map(str, fact['written']))} tokens"
            + (f", stop ahead by {' or '.join(f'{m:g}' for m in fact['margins'])}" if fact["margins"] else ""))


def _before_text(fact: dict) -> str:
    name = f"{fact['configuration']}, seed {fact['seed']}"
    if fact["before"] == "same":
        return f"{name}: no, plain greedy's tokens up to the stop"
    if fact["before"] == "unclassified":
        return f"{name}: parted from plain greedy before the stop, not classified yet"
    bug = fact["before"] == "bug"
    return (f"{name}: {'yes' if bug else 'no'}, parted from plain greedy at output token {fact['part_at']}, "
            f"{'a suspected bug' if bug else 'a near-tie'} by the classifier")


def path_facts(records: list[Record]) -> list[dict]:
    """Per vLLM release on a GPU and decoding path (FINDINGS_SCOPE): its generations, how many parted from plain
    greedy, its early stops (`early_stop_facts`), and the classifier's verdicts on its divergences."""
    from spectie.records.record_types import Verdict

    cases = classified_cases(records)
    found = []
    for (env_id, _), runs in gpu_matrix_runs(records).items():
        first = runs[0].fingerprint
        baselines = {r.parameters.prompt_seed: r.results.repeats[0] for r in runs
                     if r.is_baseline and r.results.repeats}
        for method, label in PATHS:
            mine = [r for r in runs if r.parameters.method == method and r.results.repeats]
            if not mine:
                continue
            generations = [x for r in mine for x in r.results.repeats]
            verdicts = [case for (env, _), case in cases.items() if env == env_id and case["class"] == method]
            found.append({
                "environment": env_id, "vllm": first.vllm, "gpu": first.gpu, "method": method, "path": label,
                "generations": len(generations), "prompts": len({r.parameters.prompt_seed for r in mine}),
                "parted": sum(not x.get("same_as_baseline") for x in generations),
                "stops": [] if method == "none" else early_stop_facts(mine, baselines, cases, env_id),
                "classified": len(verdicts),
                "bugs": sum(case["verdict"] != Verdict.NEAR_TIE.label for case in verdicts)})
    return found


def findings_rows(records: list[Record]) -> list[dict]:
    """`path_facts` as the first page's table: one row per release on a GPU and path."""
    rows = []
    for fact in path_facts(records):
        row = {"vLLM": fact["vllm"], "GPU": fact["gpu"], "path": fact["path"],
               "generations": f"{fact['generations']} ({fact['prompts']} prompt{'s' if fact['prompts'] != 1 else ''})"}
        if fact["method"] == "none":
            rows.append(dict(row, **{"parted from plain greedy": "(the reference)",
                                     "stopped earlier than plain greedy": "(the reference)",
                                     "wrong tokens before that stop": "", "classifier": ""}))
            continue
        classified, bugs = fact["classified"], fact["bugs"]
        rows.append(dict(row, **{
            "parted from plain greedy": f"{fact['parted']} of {fact['generations']}",
            "stopped earlier than plain greedy": "; ".join(map(_stop_text, fact["stops"])) or "never",
            "wrong tokens before that stop": "; ".join(map(_before_text, fact["stops"])),
            "classifier": (f"{bugs} of {classified} divergences suspected bugs" if bugs else
                           f"all {classified} divergences near-ties") if classified else
                          ("not classified yet" if fact["parted"] else "")}))
    return rows


def _releases(facts: list[dict]) -> str:
    """'0.26.0 (NVIDIA H200) and 0.31.0 (NVIDIA H100 80GB HBM3)'."""
    return and_list([f"{f['vllm']} ({f['gpu']})" for f in facts])


def _stops_clause(stops: list[dict]) -> str:
    """'mtp-v1-k1 and mtp-v2-k1 on prompt seed 1 (10 of 10 repeats each ...)', over one release's stops."""
    configurations = sorted({s["configuration"] for s in stops})
    seeds = sorted({s["seed"] for s in stops})
    early, repeats = {s["early"] for s in stops}, {s["repeats"] for s in stops}
    margins = sorted({m for s in stops for m in s["margins"]})
    often = (f"{early.pop()} of {repeats.pop()} repeats{' each' if len(stops) > 1 else ''}"
             if len(early) == 1 and len(repeats) == 1 else "in some repeats")
    return (f"{and_list(configurations)} on prompt seed{'s' if len(seeds) > 1 else ''} {and_list(list(map(str, seeds)))} "
            f"({often}" + (f", the stop token ahead by {' or '.join(f'{m:g}' for m in margins)} logits" if margins
                           else "") + ")")


def _grouped(facts: list[dict], clause) -> list[tuple[list[dict], str]]:
    """Releases whose `clause(fact)` reads the same, together: [(their facts, the clause)], in release order."""
    groups: dict[str, list[dict]] = {}
    for fact in facts:
        groups.setdefault(clause(fact), []).append(fact)
    return [(members, text) for text, members in groups.items()]


def path_verdicts(records: list[Record]) -> list[str]:
    """One verdict per speculative path, from `path_facts` (FINDINGS_SCOPE), each saying what it rests on."""
    facts = path_facts(records)
    said = []
    for method, label in PATHS[1:]:
        mine = [f for f in facts if f["method"] == method]
        if not mine:
            said.append(f"**{label}**: not run on a GPU here")
            continue
        parts = []
        tie_stops = [f for f in mine if not f["bugs"] and f["stops"]
                     and all(s["before"] in ("same", "near-tie") for s in f["stops"])]
        for members, text in _grouped(tie_stops, lambda f: _stops_clause(f["stops"])):
            judged = all(f["classified"] for f in members)
            parts.append(f"a near-tie that speculation took the other way: on vLLM {_releases(members)}, {text} "
                         "stopped where plain greedy went on, after writing plain greedy's tokens"
                         + (", and the classifier calls every divergence of this path there a near-tie" if judged
                            else " (its divergences are not all classified yet)"))
        bad = [f for f in mine if f["bugs"]]

        def bug_clause(f):
            corrupt = [s for s in f["stops"] if s["before"] == "bug"]
            return (f"the classifier calls {f['bugs']} of {f['classified']} divergences suspected bugs"
                    + (f"; {_stops_clause(corrupt)} then stopped silently at the tie after that corrupted output"
                       if corrupt else ""))

        for members, text in _grouped(bad, bug_clause):
            parts.append(f"a correctness bug, not a tie, on vLLM {_releases(members)}{' each' if len(members) > 1 else ''}: "
                         + text)
        other = [f for f in mine if f["stops"] and f not in tie_stops and f not in bad]
        for members, text in _grouped(other, lambda f: _stops_clause(f["stops"])):
            parts.append(f"on vLLM {_releases(members)}, {text} stopped earlier than plain greedy after parting from "
                         "it, a divergence not classified yet: tie or bug is not settled")
        clean = [f for f in mine if not f["parted"]]
        if clean:
            parts.append(f"on vLLM {_releases(clean)} it wrote plain greedy's tokens in every generation "
                         f"({and_list([str(f['generations']) for f in clean])} generations)")
        if not parts:
            parts.append(f"on vLLM {_releases(mine)} it never stopped earlier than plain greedy")
        said.append(f"**{label}**: " + "; ".join(parts))
    return said


def findings_figure(records: list[Record]):
    """`path_facts` of the speculative paths as a figure (plots.path_outcomes), or a sentence without a GPU run."""
    from spectie.book import plots

    rows = [{"label": f"vLLM {f['vllm']}, {f['gpu'].removeprefix('NVIDIA ')}: {f['path']}",
             "generations": f["generations"], "parted": f["parted"], "bug": f["bugs"] > 0,
             "stopped": sum(s["early"] for s in f["stops"])} for f in path_facts(records) if f["method"] != "none"]
    if not rows:
        return "No vLLM run on a GPU is recorded."
    return plots.path_outcomes(rows, "Speculative generations against plain greedy's, per release and path "
                                     "(the organism, every GPU run here)")


def findings_table(records: list[Record]):
    """`findings_rows` as the page's table (a styled DataFrame), or a sentence where no GPU run is recorded."""
    import pandas as pd

    rows = findings_rows(records)
    if not rows:
        return "No vLLM run on a GPU is recorded."
    return (pd.DataFrame(rows).style.hide(axis="index")
            .set_properties(**{"text-align": "left", "vertical-align": "top", "font-size": "0.85em"}))


def page_values(records: list[Record]) -> dict:
    """The first page's glue values of the findings: the table, its scope, the per-path verdicts (a claim over
    every measured record: a new GPU run changes them)."""
    verdicts = bullets(path_verdicts(records)) or "- No vLLM run on a GPU is recorded."
    return {"findings_table": findings_table(records), "findings_scope": FINDINGS_SCOPE,
            "findings_figure": findings_figure(records),
            "path_verdicts": Claim("path_verdicts", verdicts, Scope("", provenance="measured"),
                                   "spectie.book.findings:path_facts", path_facts(records), markdown=True)}
