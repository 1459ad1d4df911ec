"""The reported records reproduce every figure of the incident brief, and the chapter's tables."""

import json
import re

import pytest

from conftest import ROOT
from spectie.book import incident
from spectie.records.environments import check_record_environments, environment_status, load_environments
from spectie.records.record_types import EngineOutcome, Record
from spectie.records.store import load_records

BRIEF = ROOT / "sources" / "incident.md"
NUMBER = re.compile(r"\d+(?:\.\d+)*")


@pytest.fixture(scope="module")
def records():
    return load_records(ROOT / "results", provenance="reported")


def _numbers(text: str) -> set[str]:
    """Numbers as written, normalised so that 15.80 and 15.8 compare equal."""
    found = set()
    for n in NUMBER.findall(text):
        found.add(n)
        if n.count(".") == 1:
            found.add(repr(float(n)))
    return found


# sha256 of the incident brief as the team received it (../shared/incident.md, 2026-12-07): a clone without the
# shared folder (CI) still checks that sources/incident.md is that brief, unedited.
BRIEF_SHA256 = "6ab0bf62a9ab8674f9025f0858c6f69b436fdced96228e52898aafe1718f846c"


def test_the_brief_in_sources_is_the_shared_one():
    import hashlib

    assert hashlib.sha256(BRIEF.read_bytes()).hexdigest() == BRIEF_SHA256, "sources/incident.md was edited"
    shared = ROOT.parent / "shared" / "incident.md"
    if shared.exists():  # beside the team's checkout: the shared brief must not have moved on either
        assert BRIEF.read_text() == shared.read_text(), "sources/incident.md is out of date: copy ../shared/incident.md"


def test_every_figure_of_the_brief_is_in_a_reported_record_or_environment(records):
    stored = json.dumps([r.stored for r in records], ensure_ascii=False) + "".join(
        p.read_text() for p in sorted((ROOT / "environments").glob("*.yaml")))
    stored_numbers = _numbers(stored)
    brief_numbers = _numbers(BRIEF.read_text())
    assert {"1845", "1854", "17247", "248044", "0.67", "0.69", "33", "591.44"} <= brief_numbers
    missing = sorted(brief_numbers - stored_numbers)
    assert not missing, f"figures of the brief found in no record or environment file: {missing}"


def test_the_key_figures(records):
    by_id = {r.id: r for r in records}
    assert all(r.provenance == "reported" and r.source.title.startswith("[Bug]: Wide speculative")
               for r in records if r.chapter == "incident" and r.kind != "related-report")
    cfg = by_id["incident-configuration"]
    assert cfg.parameters.prompt_tokens == 1845
    assert cfg.parameters.max_tokens == 96
    assert cfg.parameters.num_speculative_tokens_tested == [1, 6, 7, 8]
    assert cfg.results.token_ids == {"DATA": 17247, "<|endoftext|>": 248044, "<|im_end|>": 248046}
    counts = {rid: (by_id[rid].results.runs_stopped, by_id[rid].results.runs_total)
              for rid in ("v032-mtp-k8", "v032-mtp-k1-eager", "v032-mtp-compiled-cudagraph-none")}
    assert counts == {"v032-mtp-k8": (10, 10), "v032-mtp-k1-eager": (10, 10),
                      "v032-mtp-compiled-cudagraph-none": (33, 33)}
    assert by_id["b200-k7"].results.stopped_early and not by_id["b200-k8"].results.stopped_early
    assert by_id["b200-plain-greedy"].results.stopped_early


def test_the_configuration_table_lists_every_stated_setting_as_the_record_stores_it(records):
    cfg = next(r for r in records if r.id == "incident-configuration")
    table = incident.configuration_table(cfg.parameters)
    assert list(table.index) == sorted(cfg.stored["parameters"])
    assert table.loc["num_speculative_tokens_tested", "value"] == "1, 6, 7, 8"
    assert table.loc["enforce_eager", "value"] in ("yes", "no") and table.loc["max_tokens", "value"] == 96


def test_the_logit_table_is_consistent(records):
    logits = incident.logit_comparison(records)
    assert logits.kind == "logit-comparison" and logits.results.position == 1854
    assert incident.fp32_row(records)["margin"] == 0.67
    for row in logits.results.rows:
        ordered = sorted(row["logits"].items(), key=lambda kv: kv[1], reverse=True)
        assert ordered[0][0] == row["winner"]
        assert ordered[0][1] - ordered[1][1] == pytest.approx(row["margin"], abs=0.005)
    table = incident.logit_table(logits)
    assert table.loc["fp32", "EOS logit"] == 16.47 and table.loc["bf16", "DATA logit"] == 16.50
    assert list(table["top-1"]) == ["EOS", "DATA"]


def test_the_matrix(records):
    matrix = incident.outcome_matrix(records)
    envs = load_environments()
    assert set(matrix.columns) == {"vLLM v0.31.0 · 2 × RTX 4090", "vLLM v0.31.0 or nightly 77154ca6 · B200",
                                   "vLLM v0.32.0 · RTX 4090"}
    v032 = matrix[incident.environment_label(["v0.32.0-rtx4090"], envs)]
    assert v032["mtp, K = 8"] == "stopped 10/10"
    assert v032["mtp, K = 1, eager"] == "stopped 10/10"
    assert v032["mtp, K not stated, compiled, cudagraph_mode=NONE"] == "stopped 33/33"
    original = matrix[incident.environment_label(["v0.31.0-rtx4090x2"], envs)]
    assert original["ngram_gpu (V1), K ∈ {7, 8}, eager"] == "stopped at prompt_len+8"
    b200 = matrix[incident.environment_label(["v0.31.0-b200", "nightly-77154ca6-b200"], envs)]
    assert b200["method not stated, K = 8"] == "continued"
    assert b200["plain greedy (no speculation)"] == "stopped at prompt_len+8"
    assert (matrix == incident.NOT_REPORTED).sum().sum() > 0


def measured_in(environment: str, records: list[Record]) -> Record:
    """One of the incident's engine outcomes, as if measured in `environment`."""
    reported = next(r for r in records if r.kind == "engine-outcome")
    return Record.from_dict(dict(reported.stored, provenance="measured", environments=[environment]))


def test_environments_and_their_status(records):
    envs = load_environments()
    assert {"v0.31.0-rtx4090x2", "v0.31.0-b200", "nightly-77154ca6-b200", "v0.32.0-rtx4090", "cpu", "h200"} <= set(envs)
    assert not check_record_environments(records)
    assert environment_status("v0.32.0-rtx4090", records) == "reported only"
    assert environment_status("h200", records) == "not yet run"
    assert environment_status("h200", records + [measured_in("h200", records)]) == "measured here"


def test_a_planned_environment_says_why_it_has_no_record_only_while_it_has_none(records):
    from spectie.records.environments import pending_text

    env = {"id": "h200", "pending": "not run\n  yet."}
    assert pending_text(env, records) == "not run yet."
    assert pending_text(env, records + [measured_in("h200", records)]) is None
    assert pending_text({"id": "h200"}, records) is None


def test_the_reports_three_names_for_the_stop_are_set_side_by_side():
    from spectie.book.incident import positions_text

    text = positions_text(1845, 8, 10, 1854)
    assert "the end-of-text token sits at 1855 and was chosen by the logits at 1854, which agrees" in text
    assert text.endswith("`prompt_len + 8` = 1853 names neither the end-of-text token nor the logits that chose it: "
                         "the report's counts do not agree with one another")
    assert positions_text(1845, 9, 10, 1854).endswith("names the logits that chose it: the three name one stop")


def test_a_measured_stop_is_labelled_by_the_tokens_written_before_it():
    from spectie.book.incident import outcome_label

    measured = {"stopped_early": True, "runs_stopped": 3, "runs_total": 3, "output_tokens_before_stop": 92}
    assert outcome_label(EngineOutcome.from_dict(measured)) == "stopped 3/3 after 92 tokens"
    assert outcome_label(EngineOutcome.from_dict({**measured, "stop_offset_from_prompt_len": 8})) == (
        "stopped 3/3 at prompt_len+8")
    assert outcome_label(EngineOutcome.from_dict({**measured, "stopped_early": False})) == "continued"
