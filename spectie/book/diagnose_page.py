"""The one-page verdict on an operator's request (spectie.book.diagnose ran it): per configuration what vLLM did against
plain greedy, the classifier's verdict on each divergence, the detector on the stops vLLM served (and on the
operator's own response, where the log line holds it), the fix ledger for the installed release, and what to do.
Every sentence is computed from the diagnosis's records.

    values = page_values(records, diagnosis)    # glue values: answers, tables, figure
"""

from __future__ import annotations

from spectie.records.completions import baseline_run, stopped_earlier, tokens_before_stop, tokens_written
from spectie.book.pages import and_list, device_of
from spectie.records.record_types import Record
from spectie.tools.tiestop import is_near_tie

LEDGER_ISSUE = "39273"  # GDN state under speculation: the fixes the ledger follows


def configuration_rows(records: list[Record], threshold: float) -> list[dict]:
    """Per configuration: its repeats, how many stopped and how many stopped earlier than plain greedy's first
    repeat, the tokens written, where it first parted from plain greedy, and the narrowest stop margin vLLM served
    (top-2 logprobs) with whether the detector flags it (`threshold`)."""
    base = baseline_run(records)
    first = base.results.repeats[0] if base and base.results.repeats else None
    rows = []
    for r in records:
        repeats = r.results.repeats or []
        margins = [x["stop_margin"]["margin"] for x in repeats
                   if x["finish_reason"] == "stop" and x.get("stop_margin") and x["stop_margin"].get("margin") is not None]
        parted = [x["first_divergence"] for x in repeats if x.get("first_divergence") is not None]
        rows.append({
            "configuration": r.parameters.configuration, "status": r.results.status, "repeats": len(repeats),
            "stopped": sum(x["finish_reason"] == "stop" for x in repeats),
            "stopped earlier than plain greedy": (sum(stopped_earlier(x, first) for x in repeats)
                                                  if first is not None and r is not base else ""),
            "tokens written": ", ".join(str(n) for n in sorted({tokens_written(x) for x in repeats})) or "—",
            "first parted at output token": 1 + min(parted) if parted else None,
            "narrowest stop margin": min(margins) if margins else None,
            "flagged by the detector": any(is_near_tie(m, threshold) for m in margins) if margins else None})
    return rows


def classified(records: list[Record], device: str) -> dict[str, object]:
    """The classifier's verdict (spectie.tools.divergence.Divergence) on each configuration whose first repeat parts from
    plain greedy's first repeat: configuration -> its divergence."""
    from spectie.tools import divergence

    base = baseline_run(records)
    verdicts = {}
    for r in records:
        repeats = r.results.repeats or []
        if base is None or r is base or not repeats or repeats[0].get("first_divergence") is None:
            continue
        pair = divergence.pair_from_records(r, base)
        verdicts[r.parameters.configuration] = divergence.classify(
            r.parameters.model if r.parameters.model != "organism" else "organism", pair["prompt_token_ids"],
            pair["a"], pair["b"], device=device)
    return verdicts


def failed_text(rows: list[dict]) -> str:
    """The configurations vLLM did not run here (refused or crashed), said as such: '' when every one ran."""
    failed = [f"{r['configuration']} ({r['status']})" for r in rows if r["status"] != "ok"]
    return f"; did not run here: {and_list(failed)} (the record holds vLLM's error)" if failed else ""


def reproduces_text(rows: list[dict]) -> str:
    """Does the stop reproduce here, and how often?"""
    return _reproduces(rows) + failed_text(rows)


def _reproduces(rows: list[dict]) -> str:
    early = [r for r in rows if r["stopped earlier than plain greedy"]]
    if not any(r["stopped"] for r in rows):
        return "No: no configuration stopped; every completion ran to the request's max_tokens"
    if not early:
        ran = [r for r in rows if r["stopped earlier than plain greedy"] != "" and r["status"] == "ok"]
        if not ran:
            return "Not measured: no speculative configuration ran"
        return (f"No: no speculative configuration stopped earlier than plain greedy here "
                f"({and_list([r['configuration'] for r in ran])}, {max(r['repeats'] for r in ran)} repeats each)")
    return "Yes: " + "; ".join(f"{r['configuration']} stopped earlier than plain greedy in "
                               f"{r['stopped earlier than plain greedy']} of {r['repeats']} repeats (after "
                               f"{r['tokens written']} tokens)" for r in early)


def plain_text(records: list[Record], threshold: float) -> str:
    """Does plain greedy stop there too? And by what margin its stop won, against the detector's threshold."""
    base = baseline_run(records)
    if base is None or not base.results.repeats:
        return "Not measured: plain greedy did not finish"
    first = base.results.repeats[0]
    if first["finish_reason"] != "stop":
        return (f"No: plain greedy wrote all {first['output_tokens']} tokens the request allows "
                f"(finish_reason {first['finish_reason']})")
    said = f"Yes: plain greedy stopped too, after {tokens_before_stop(first)} tokens"
    margin = (first.get("stop_margin") or {}).get("margin")
    if margin is not None:
        said += (f"; its stop won by {margin:.3f} logits in vLLM's own logprobs, "
                 f"{'within' if is_near_tie(margin, threshold) else 'beyond'} the detector's threshold")
    return said


def verdict_text(verdicts: dict, rows: list[dict], threshold: float) -> str:
    """Is it a near-tie or a suspected bug? Each divergence's verdict, the fp32 margin between the two tokens at
    the first difference, and the narrowest stop margin vLLM served against the detector's threshold."""
    if not verdicts:
        return "Nothing to classify: every speculative configuration wrote plain greedy's tokens"
    parts = [f"{configuration}: {result.verdict.short}: {result.explanation}" for configuration, result in
             verdicts.items()]
    stops = [r for r in rows if r["narrowest stop margin"] is not None and r["stopped earlier than plain greedy"]]
    parts += [f"{r['configuration']}'s stop won by {r['narrowest stop margin']:.3f} logits in vLLM's own logprobs, "
              f"{'within' if r['flagged by the detector'] else 'beyond'} the detector's {threshold:.3f}" for r in stops]
    return "; ".join(parts)


def stops_to_reference(records: list[Record]) -> dict[str, tuple[int, ...]]:
    """The stops worth a reference: each configuration's first repeat that ended on a stop (plain greedy's, and every
    one that stopped earlier than it), as its output tokens up to and with the stop token; one per distinct output."""
    base = baseline_run(records)
    first = base.results.repeats[0] if base and base.results.repeats else None
    chosen: dict[tuple[int, ...], str] = {}
    for r in records:
        repeat = (r.results.repeats or [None])[0]
        if repeat and repeat["finish_reason"] == "stop" and (r is base or stopped_earlier(repeat, first)):
            chosen.setdefault(tuple(repeat["token_ids"]), r.parameters.configuration)
    return {configuration: tokens for tokens, configuration in chosen.items()}


def stop_references(model_path: str, prompt: list[int], stops: dict[str, tuple[int, ...]], device: str) -> dict:
    """At each stop (the last of its tokens), fp32's and bf16's margin of the stop token over the best other token,
    from the same context (transformers, teacher-forced, one model per precision): configuration -> margins."""
    from spectie.lab.model import load_model, teacher_forced_logits
    from spectie.lab.tokenizer import model_tokenizer

    found = {configuration: {"position": len(tokens)} for configuration, tokens in stops.items()}
    for dtype, name in (("float32", "fp32"), ("bfloat16", "bf16")):
        model = load_model(model_path, dtype, device) if stops else None
        for configuration, tokens in stops.items():
            ids = list(prompt) + list(tokens)
            row = teacher_forced_logits(model, ids, [len(ids) - 1])[0]
            stop, others = ids[-1], row.clone()
            others[stop] = float("-inf")
            found[configuration][name] = float(row[stop] - others.max())
            found[configuration]["runner_up"] = model_tokenizer(model_path).decode([int(others.argmax())])
    return found


def references_text(found: dict, band: float, origin: str) -> str:
    """The references at each stop against the noise band recorded for these weights."""
    if not found:
        return "no stop to reference: no configuration's first repeat stopped"
    return "; ".join(
        f"at {configuration}'s stop (output token {ref['position']}), the stop token "
        f"{'leads' if ref['fp32'] >= 0 else 'trails'} {ref['runner_up']!r} by {abs(ref['fp32']):.3f} logits in fp32, "
        f"and {'leads' if ref['bf16'] >= 0 else 'trails'} it by {abs(ref['bf16']):.3f} in bf16: "
        f"{'inside' if is_near_tie(ref['fp32'], band) else 'outside'} the noise band of {band:.3f} ({origin})"
        for configuration, ref in found.items())


def ledger_text(version: str) -> str:
    """Which public fixes for GDN state under speculation (#39273) the release carries (the committed ledger)."""
    from spectie.tools.fixes import ledger_record, pull_requests_text

    return f"vLLM {version}: " + pull_requests_text(ledger_record(), version, LEDGER_ISSUE)


def advice_text(rows: list[dict], verdicts: dict, plain: str) -> str:
    """What to do, from the answers: the guard for a near-tie stop, upstream and another release for a suspected
    bug, the model's own stop when plain greedy stops too, or where to look next when nothing reproduced."""
    from spectie.records.record_types import Verdict

    early = [r["configuration"] for r in rows if r["stopped earlier than plain greedy"]]
    flagged = {c: v for c, v in verdicts.items() if v.verdict is Verdict.BUG}
    # Speculation's only where its own tokens leave the band (or the first difference does); plain greedy's alone
    # leaving it says the band is narrower than this host's own bf16 decoding, not that speculation broke.
    bugs = [c for c, v in flagged.items() if v.outside_band_a or abs(v.reference_margin or 0) > v.threshold]
    plain_only = [c for c in flagged if c not in bugs]
    if not any(r["stopped"] for r in rows) and not flagged:
        return "nothing: no completion stopped early here, and no divergence from plain greedy is a suspected bug"
    said = []
    if bugs:
        said.append(f"a suspected correctness bug ({and_list(bugs)}): report it upstream with these records, and do "
                    "not serve that speculative method on this release; the fix ledger below says which release "
                    "carries the public fixes")
    if plain_only:
        said.append(f"the classifier's suspected bug for {and_list(plain_only)} rests on plain greedy's own tokens, "
                    "which leave the noise band without any speculation: not a fault of speculation, and no "
                    "speculative fix applies; the band is narrower than this host's bf16 decoding there")
    near = [c for c in early if c in verdicts and verdicts[c].verdict is Verdict.NEAR_TIE]
    if near and not bugs:
        said.append(f"a near-tie stop ({and_list(near)}): run behind the guard (spectie guard serve --upstream "
                    "<vllm serve URL> --model <model folder>), or serve requests whose completeness matters "
                    "without speculation; no K is safe by itself")
    unjudged = [c for c in early if c not in verdicts]
    if unjudged:
        said.append(f"an earlier stop the classifier did not judge ({and_list(unjudged)}): classify it with spectie "
                    "classify --record <its record> before choosing")
    if plain.startswith("Yes"):
        said.append("plain greedy stops too: the stop is the model's own, not speculation's")
    if not early and not bugs:
        said.append("nothing reproduced here: a stop that depends on the batch (other requests in flight) or on "
                    "the GPU's kernels needs your server's load and hardware; re-run with ENV= your deployment's "
                    "environment on its GPU")
    return "; ".join(said)


def response_text(diagnosis, threshold: float) -> str:
    """The detector on the operator's own response (where the log line holds it)."""
    from spectie.tools import tiestop

    if diagnosis.request.response is None:
        return "no response in the request file (give a log line with its response to check it)"
    verdicts = [tiestop.check(c, threshold, tiestop.end_of_text(diagnosis.model_path))
                for c in tiestop.from_openai(diagnosis.request.response, diagnosis.request.source)]
    return "; ".join(v.explanation for v in verdicts)


def page_values(records: list[Record], diagnosis) -> dict:
    """The page's glue values: the request, the four answers in order, the configurations' table, the repeat grid,
    the fix ledger for the installed release, the operator's own response, and where the records came from."""
    from spectie.book import reproduce
    from spectie.records.store import provenance_line
    from spectie.tools.thresholds import detector_threshold_for_model, threshold_for_model

    # the bands recorded for these weights on this machine's device (the one the classifier's reference runs on)
    threshold, origin = detector_threshold_for_model(diagnosis.model_path)
    band, band_origin = threshold_for_model(diagnosis.model_path)
    found = stop_references(diagnosis.model_path, list(diagnosis.prompt), stops_to_reference(records),
                            diagnosis.device)
    rows = configuration_rows(records, threshold)
    verdicts = classified(records, diagnosis.device)
    plain = plain_text(records, threshold)
    version = diagnosis.probe["vllm_version"]
    grid = reproduce.repeat_grid(records, diagnosis.request.max_tokens, f"vLLM {version}, {diagnosis.model_label}",
                                 {c: v.verdict.short for c, v in verdicts.items()})
    return {"diagnosis_plan": diagnosis.describe(), "reproduces": reproduces_text(rows), "plain": plain,
            "verdict": verdict_text(verdicts, rows, threshold), "advice": advice_text(rows, verdicts, plain),
            "references": references_text(found, band, band_origin),
            "threshold": threshold, "threshold_origin": origin, "ledger": ledger_text(version),
            "response_check": response_text(diagnosis, threshold),
            "configurations_table": styled(rows),
            "repeat_grid": grid, "provenance": provenance_line(records)}


def styled(rows: list[dict]):
    """Configuration rows as a table: margins to 3 decimals, a token position as a whole number, "—" for none."""
    import pandas as pd

    frame = pd.DataFrame(rows).astype({"first parted at output token": "Int64"})
    return frame.style.format(precision=3, na_rep="—").hide(axis="index")


def elsewhere_values(records: list[Record]) -> dict:
    """The same request diagnosed elsewhere (spectie.book.diagnose.diagnosed_elsewhere): per environment and host, how many
    repeats of each configuration stopped and the tokens they wrote, in a sentence and a table."""
    from spectie.records.store import provenance_line

    groups = {}
    for r in records:
        groups.setdefault(device_of(r), []).append(r)
    if not groups:
        return {"elsewhere": "none committed for this request", "elsewhere_table": "—", "provenance_elsewhere": ""}
    said, table = [], []
    for where, rs in groups.items():
        rows = [{k: v for k, v in row.items() if k != "flagged by the detector"}
                for row in configuration_rows(rs, threshold=0.0)]
        said.append(f"{where}: " + "; ".join(f"{row['configuration']} stopped in {row['stopped']} of {row['repeats']} "
                                             f"repeats (tokens written: {row['tokens written']})" for row in rows))
        table += [{"where": where, **row} for row in rows]
    return {"elsewhere": " · ".join(said), "provenance_elsewhere": provenance_line(records),
            "elsewhere_table": styled(table)}
