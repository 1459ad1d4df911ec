"""Claims as data (spectie.book.claims): every claim the built book makes holds over every record, and a record outside
a claim's scope leaves it standing only because the sentence names that scope."""

import copy

import pytest

from spectie.book.claims import Claim, Scope, claims_in
from spectie.records.record_types import Record
from spectie.records.store import load_records, read_stored

# The sentences that state counts, absences or comparisons over runs, as claims, by chapter.
CLAIMED = {"guidance": {"ends_text", "stops_text", "survey_stops_text", "survey_fp_text", "guard_text", "rows_text",
                        "determinism_text", "survey_verdict", "detector_text", "detector_swing_text",
                        "classifier_score", "changed_text", "b200_k_text"},
           "summary": {"commit_text", "path_verdicts", "answer", "strength", "why_strength", "tie_note", "because",
                       "caveats", "not_measured", "gpu_findings", "ngram_advice", "guard_devices"}}
# The unscoped claims that a GPU run's early stop and a bug-class divergence on it must change (the others, such as
# the verdict on the incident's own stop, rest on records those leave alone).
CHANGED_BY_A_GPU_BUG = {"commit_text", "path_verdicts", "caveats", "gpu_findings"}


@pytest.fixture(scope="module")
def book(built):
    """The claims of the built book by name, and every record the build's results hold."""
    root = built[0]
    claims = {}
    for chapter in CLAIMED:
        claims.update({c.name: c for c in claims_in(root / "book" / "generated" / f"{chapter}.ipynb")})
    return claims, load_records(root / "results"), root


def test_every_claim_of_the_built_book_holds_over_every_record(book):
    """Each claim's measure, over the records of its scope among all of them, gives what its sentence states; a
    sentence either names its scope or covers every record of its kind."""
    claims, records, _ = book
    assert set(claims) >= set().union(*CLAIMED.values())
    for claim in claims.values():
        assert claim.holds(records), (claim.name, claim.text, claim.measured(records), claim.facts)
        assert claim.names_its_scope() or not claim.scope.words, claim.text


def _gpu_runs(root, records: list[Record]) -> list[Record]:
    """A GPU matrix run of another host, without a project commit: plain greedy to the limit, and MTP K=1 writing
    other tokens (fewer data rows) and stopping earlier, at a stop the detector flags, its repeats not all the same
    (made from a plain greedy record of the build)."""
    plain = next(r for r in records if r.kind == "engine-outcome" and r.parameters.configuration == "plain"
                 and r.results.repeats and r.results.repeats[0]["finish_reason"] == "length")
    [path] = (root / "results" / "measured").glob(f"*/reproduce/{plain.id}.json")
    made = []
    for configuration, stop in (("plain", False), ("mtp-k1", True)):
        stored = copy.deepcopy(read_stored(path))
        stored.update(id=f"reproduce-v0-32-0-h100-{configuration}-s0-0123456789ab", environments=["v0.32.0-h100"])
        stored["fingerprint"].update(host_id="0123456789ab", gpu="NVIDIA H100 80GB HBM3", source_commit=None)
        stored["parameters"].update(configuration=configuration, method="mtp" if stop else "none")
        repeat = stored["results"]["repeats"][0]
        if stop:
            repeat.update(token_ids=repeat["token_ids"][:3] + [0], output_tokens=4, finish_reason="stop",
                          stop_margin={"stop_token": "<|endoftext|>", "margin": 0.01, "runner_up": "x"})
            stored["results"]["distinct_outputs"] = 2  # and its repeats disagree
        made.append(Record.from_dict(stored))
    return made


def _bug_verdict(root) -> Record:
    """The classifier's verdict record on that run: its MTP divergence a suspected bug (made from one of the
    build's verdict records on a GPU release)."""
    from spectie.tools.divergence import Verdict

    path = sorted((root / "results" / "measured").glob("*/guidance/divergence-verdicts-v0.32.0-h100-*.json"))[0]
    stored = read_stored(path)
    stored["id"] = "divergence-verdicts-v0.32.0-h100-0123456789ab"
    stored["fingerprint"].update(host_id="0123456789ab", source_commit=None)
    stored["results"]["rows"] = [dict(stored["results"]["rows"][0], case="mtp-k1 vs plain, seed 0", output_token=2,
                                      verdict=Verdict.BUG.label, fp32_margin=-9.0)]
    return Record.from_dict(stored)


def _other_hosts_surveys(root) -> list[Record]:
    """Tie-stop surveys of other hosts: a copy of each of the build's, under another host id."""
    made = []
    for number, path in enumerate(sorted((root / "results" / "measured").glob("*/guidance/tiestop-survey-*.json"))):
        stored = read_stored(path)
        stored["id"] = f"tiestop-survey-cpu-01234567890{number}"
        stored["fingerprint"].update(host_id=f"01234567890{number}", source_commit=None)
        made.append(Record.from_dict(stored))
    return made


def _other_hosts_case_scores(root) -> list[Record]:
    """The classifier's labelled cases scored on another host, where it caught one more planted bug (a copy of a CPU
    build's record)."""
    path = sorted((root / "results" / "measured").glob("cpu-*/guidance/classifier-cases-*.json"))[0]
    stored = read_stored(path)
    stored["id"] = "classifier-cases-cpu-0123456789ab"
    stored["fingerprint"].update(host_id="0123456789ab", source_commit=None)
    missed = next(row for row in stored["results"]["rows"] if row["truth"] == "bug" and not row["right"])
    missed["right"] = True
    return [Record.from_dict(stored)]


def test_a_gpu_stop_outside_a_claims_scope_leaves_it_standing_and_dropping_the_scope_breaks_it(book):
    """A GPU run of another host whose speculative completion stops earlier, a bug-class divergence on it, and other
    hosts' surveys and case scores: each scoped claim still holds (the sentence names the runs it covers, and the
    new ones are not among them), and the same claim without its scope fails. Unscoped claims that rest on such
    records change."""
    claims, records, root = book
    more = (records + _gpu_runs(root, records) + [_bug_verdict(root)] + _other_hosts_surveys(root)
            + _other_hosts_case_scores(root))
    for claim in claims.values():
        if claim.scope.words:
            assert claim.holds(more), claim.name
            dropped = Claim(claim.name, claim.text, claim.scope.unscoped(), claim.measure, claim.facts,
                            claim.arguments)
            assert not dropped.holds(more), f"{claim.name} would hold without its scope: {claim.text}"
        elif claim.name in CHANGED_BY_A_GPU_BUG:
            assert not claim.holds(more), f"{claim.name} did not change with a new record: {claim.text}"


def test_a_scope_selects_by_each_field_and_a_claim_round_trips(measured_record):
    from conftest import typed

    record = typed({**measured_record, "kind": "engine-outcome", "results": {"status": "ok"},
                    "parameters": {"prompt_seed": 5, "configuration": "plain"}})
    assert Scope("", "engine-outcome").covers(record) and not Scope("", "tiestop-survey").covers(record)
    assert Scope("w", environments=("cpu",), prompt_seeds=(5,)).covers(record)
    assert not Scope("w", prompt_seeds=(0,)).covers(record) and not Scope("w", hosts=("nope",)).covers(record)
    assert not Scope("w", provenance="reported").covers(record)
    claim = Claim("x", "in w, 1 of 2", Scope("w", "engine-outcome", hosts=("a",)), "spectie.book.claims:commit_facts",
                  {"measured": 1, "with_commit": 0}, {})
    assert Claim.from_json(claim.to_json()) == claim and claim.names_its_scope()
    assert claim.scope.unscoped() == Scope("", "engine-outcome")
