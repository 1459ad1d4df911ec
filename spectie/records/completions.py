"""What a recorded completion says, compared with another or on its own: where two first part, how many tokens it
wrote before its stop, whether it stopped before another did. Pure functions of the records' token lists (the
runner derives records with them; the classifier, the pages and the first page read records with them)."""

from __future__ import annotations


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first output token that differs (or where one sequence ends), None if identical."""
    for index, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def tokens_before_stop(repeat: dict) -> int | None:
    """Output tokens written before the stop, as the report counts them ("stops after the 10th output token").

    vLLM keeps the end-of-text (or stop-token) id as the last of a stopped request's `token_ids`, so
    `output_tokens` counts it; a stop string (`stop_reason` a str) ends on ordinary text tokens."""
    if repeat["finish_reason"] != "stop":
        return None
    return repeat["output_tokens"] - (0 if isinstance(repeat.get("stop_reason"), str) else 1)


def tokens_written(repeat: dict) -> int:
    """Output tokens a repeat wrote, the end-of-text token not counted (as the report counts: "stops after
    the 10th output token"); a repeat that ran to max_tokens wrote all of them."""
    before = tokens_before_stop(repeat)
    return repeat["output_tokens"] if before is None else before


def stopped_earlier(repeat: dict, baseline: dict) -> bool:
    """Whether a repeat stopped before its baseline did: it stopped where the baseline ran to the limit, or
    both stopped and it wrote fewer tokens (the end-of-text token not counted on either side)."""
    if repeat["finish_reason"] != "stop":
        return False
    return baseline["finish_reason"] != "stop" or tokens_written(repeat) < tokens_written(baseline)


def stop_moved(repeat: dict, baseline: dict) -> str:
    """Where a repeat's stop lies against its baseline's: "same" (both ran to the limit, or both stopped after as many
    tokens), "earlier" or "later" (both stopped), "only here" or "only in the baseline" (one of them stopped).
    `stopped_earlier` is "earlier" or "only here"."""
    here, there = repeat["finish_reason"] == "stop", baseline["finish_reason"] == "stop"
    if here != there:
        return "only here" if here else "only in the baseline"
    if not here or tokens_written(repeat) == tokens_written(baseline):
        return "same"
    return "earlier" if stopped_earlier(repeat, baseline) else "later"


def baseline_run(runs):
    """The run of the baseline configuration (plain greedy) among engine runs (`Record.is_baseline`), or None."""
    return next((r for r in runs if r.is_baseline), None)
