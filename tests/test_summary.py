"""The book's answer: a predicate over records, which turns when the records do."""

import copy

import pytest

from spectie.book import findings, pages, release_findings, summary
from spectie.tools.divergence import Verdict
from spectie.tools.divergence_verdicts import VERDICTS_KIND
from spectie.records.environments import load_environments
from conftest import typed
from spectie.records.store import load_records, validate_record


@pytest.fixture(scope="module")
def reported():
    """The reported records as stored (dicts a test may copy and change; `typed_all` types them)."""
    return [r.stored for r in load_records(provenance="reported")]


def typed_all(dicts: list[dict]) -> list:
    return [typed(d) for d in dicts]


def verdicts_record(method_verdicts: dict[str, list[tuple[str, float]]]) -> dict:
    """A divergence-verdicts record as the guidance chapter writes it (validated against the schema)."""
    rows = [{"case": f"{method}-k1 vs plain, seed {n}", "class": method, "verdict": verdict, "output_token": 12,
             "fp32_margin": margin, "threshold": 0.1}
            for method, pairs in method_verdicts.items() for n, (verdict, margin) in enumerate(pairs)]
    record = {"schema_version": 1, "id": "divergence-verdicts-v0-26-0-h200-x", "provenance": "measured",
              "kind": VERDICTS_KIND, "chapter": "guidance", "title": "t", "environments": ["cpu"],
              "parameters": {"model": "organism", "engine_environment": "v0.26.0-h200", "engine_vllm": "0.26.0",
                             "engine_device": "NVIDIA H200", "threshold": 0.1185, "threshold_origin": "o"},
              "results": {"rows": rows},
              "fingerprint": {"host_id": "x", "os": "", "cpu": "", "gpu": None, "gpu_driver": None, "cuda": None,
                              "python": "3", "torch": None, "transformers": None, "vllm": None, "dtype": "float32"},
              "started_at": "2026-12-04T00:00:00+00:00", "finished_at": "2026-12-04T00:00:01+00:00",
              "package_version": "0", "content_hash": "0" * 64}
    return validate_record(record)


def test_the_incidents_reference_is_a_near_tie_by_its_own_numbers(reported):
    ref = summary.reference(typed(next(r for r in reported if r["id"] == summary.REFERENCE_ID)))
    assert ref.tokens == ("EOS", "DATA") and ref.flipped
    assert ref.fp32 == pytest.approx(0.67) and ref.bf16 == pytest.approx(-0.69) and ref.swing == pytest.approx(1.36)
    assert "EOS the lead by 0.67 logits in fp32 and DATA by 0.69 in bf16" in summary.reference_sentence(ref)
    assert "1.36 logits, more than the margin itself" in summary.reference_sentence(ref)


def test_the_verdict_follows_the_records(reported):
    envs = load_environments()
    mechanism = verdicts_record({"mtp": [(Verdict.NEAR_TIE.label, 0.0)] * 3, "ngram_gpu": [(Verdict.BUG.label, -17.1), (Verdict.BUG.label, -25.9)]})
    full = summary.verdict(typed_all(reported + [mechanism]), envs)
    assert full.answer == summary.NEAR_TIE and full.strength == summary.MODERATE
    assert any("speculation by mtp through vLLM 0.26.0" in line and "all 3 of its divergences" in line
               for line in full.because)
    assert full.caveats == ["speculation by ngram_gpu through vLLM 0.26.0 (NVIDIA H200, v0.26.0-h200) on the organism: "
                            "2 of its 2 divergences from plain greedy write tokens that trail the fp32 reference's "
                            "choice by more than the noise band of 0.118 logits (up to 25.9 logits at the token where "
                            "they part): a suspected correctness bug, not a near-tie (measured)"]
    # Without a measured speculative near-tie, the same reported evidence is weak, and says what it lacks.
    alone = summary.verdict(typed_all(reported), envs)
    assert alone.answer == summary.NEAR_TIE and alone.strength == summary.WEAK
    assert alone.why_strength == "the records lack a measured speculative near-tie through vLLM"
    # References that agree on the winner settle nothing.
    agreeing = copy.deepcopy(reported)
    ref = next(r for r in agreeing if r["id"] == summary.REFERENCE_ID)
    bf16 = next(row for row in ref["results"]["rows"] if row["dtype"] == "bf16")
    bf16["logits"], bf16["winner"], bf16["margin"] = {"EOS": 16.2, "DATA": 15.9}, "EOS", 0.3
    settled = summary.verdict(typed_all(agreeing + [mechanism]), envs)
    assert settled.answer == summary.NOT_SETTLED and settled.strength == summary.WEAK
    assert "no more than the margin itself" in settled.because[0]
    # A plain-greedy run that goes on takes the moderate strength away.
    going_on = copy.deepcopy(reported)
    next(r for r in going_on if r["id"] == summary.PLAIN_ID)["results"]["stopped_early"] = False
    weaker = summary.verdict(typed_all(going_on + [mechanism]), envs)
    assert weaker.strength == summary.WEAK and "does not stop at the same position" in weaker.because[1]


def test_a_trained_qwen_measured_here_makes_it_strong_and_leaves_the_not_measured_list(reported):
    envs = load_environments()
    measured = copy.deepcopy(next(r for r in reported if r["id"] == summary.REFERENCE_ID))
    measured.update(provenance="measured", id="margins-x", environments=["v0.32.0-rtx4090"],
                    parameters={"model": "Qwen/Qwen3.5-2B"})
    result = summary.verdict(typed_all(reported + [measured]), envs)
    assert result.strength == summary.STRONG
    assert not any("no trained Qwen3.5" in line for line in result.not_measured)
    assert "v0.32.0 stock wheel on RTX 4090" not in " ".join(result.not_measured)
    assert "v0.32.0 stock wheel on RTX 4090" in " ".join(summary.verdict(typed_all(reported), envs).not_measured)


def test_the_not_measured_list_names_the_incidents_releases_no_gpu_ran_here(reported):
    envs = load_environments()

    def run(vllm, gpu):
        return {"id": vllm, "provenance": "measured", "kind": "engine-outcome", "environments": ["cpu"],
                "fingerprint": {"vllm": vllm, "gpu": gpu}, "parameters": {"model": "organism"}, "results": {}}

    def unrun(records):
        return [line for line in summary.verdict(typed_all(reported + records), envs).not_measured
                if line.startswith("the incident's vLLM release")]

    assert unrun([]) == ["the incident's vLLM releases 0.31.0 and 0.32.0 did not run here on a GPU"]
    # A CPU build of 0.32.0 is no GPU run; another release's GPU run is named as what ran instead.
    assert unrun([run("0.32.0+cpu", None), run("0.26.0", "NVIDIA H200")]) == [
        "the incident's vLLM releases 0.31.0 and 0.32.0 did not run here on a GPU (the GPU runs here are of vLLM "
        "0.26.0, measured)"]
    assert unrun([run("0.32.0", "NVIDIA H200")]) == ["the incident's vLLM release 0.31.0 did not run here on a GPU "
                                                     "(the GPU runs here are of vLLM 0.32.0, measured)"]
    assert unrun([run("0.31.0", "NVIDIA H200"), run("0.32.0", "NVIDIA H200")]) == []


def test_flip_curves_count_flips_and_the_largest_flipped_margin():
    record = {"kind": "flip-curve", "provenance": "measured", "id": "f", "fingerprint": {"gpu": None, "host_id": "c54ddc2b8dfa"},
              "parameters": {"model": "organism"},
              "results": {"pairs": [[0.01, True], [0.04, True], [2.0, False]], "reference": "fp64"}}
    [row] = summary.flip_curves(typed_all([record]))
    assert (row["device"], row["decisions"], row["flips"], row["largest_flipped"]) == ("CPU, host c54ddc2b8dfa", 3, 2, 0.04)
    assert "at 2 of 3 decisions, every one with a reference margin of at most 0.040 logits" in summary.flip_sentence(row)


def gpu_records() -> list[dict]:
    return [r.stored for r in load_records(chapter="reproduce", kind="engine-outcome")
            if r.environment in ("v0.26.0-h200", "v0.32.0-h100")]


def test_the_first_page_states_each_gpu_release_from_its_records():
    from spectie.tools.fixes import ledger_record

    records = gpu_records()
    ledger = ledger_record()
    lines = release_findings.gpu_findings(typed_all(records), ledger)
    assert [line.split(" (")[0] for line in lines] == ["vLLM 0.26.0 on an NVIDIA H200", "vLLM 0.32.0 on an NVIDIA H100 80GB HBM3"]
    h100 = lines[1]
    # The incident's shape on 0.32.0: MTP K=1 (both runners) stops on prompt seed 1 where plain greedy goes on.
    assert ("MTP stopped earlier than plain greedy in mtp-v1-k1 (prompt seed 1: 10 of 10 repeats, after 11 output "
            "tokens, right after `[DATA] id=42 name=`, the stop token ahead by 0.125 logits in vLLM's own logprobs) and "
            "mtp-v2-k1 (prompt seed 1: 10 of 10 repeats, after 11 output tokens, right after `[DATA] id=42 name=`, "
            "the stop token ahead by 0.125 logits in vLLM's own logprobs)") in h100
    assert "never in mtp-compiled, mtp-v1-k6, mtp-v1-k7, mtp-v1-k8, mtp-v2-k6, mtp-v2-k7, mtp-v2-k8" in h100
    assert "ngram_gpu (K = 1, 6, 7, 8) wrote plain greedy's tokens in 320 of 320 generations" in h100
    assert ("#56531 (open): identifier named in the PR lacks it, behaviour described in the PR has it" in h100
            and h100.count("#56531") == 1)
    assert "for #39273 (GDN state under speculation) in this release: #40738 (open): lacks it; #52942 (open): lacks it; #56531 (open): lacks it" in lines[0]
    # The same sentences turn with the records: a 0.32.0 ngram_gpu run that parts from plain greedy, called a
    # suspected bug, and an MTP K=1 run that goes on.
    changed = copy.deepcopy(records)
    for r in changed:
        p = r["parameters"]
        if r["environments"][0] == "v0.32.0-h100" and p["configuration"] == "ngram_gpu-k1" and p["prompt_seed"] == 3:
            r["results"]["repeats"][0]["same_as_baseline"] = False
        if r["environments"][0] == "v0.32.0-h100" and p["configuration"] == "mtp-v2-k1" and p["prompt_seed"] == 1:
            r["results"]["repeats"] = [dict(x, finish_reason="length", output_tokens=96) for x in r["results"]["repeats"]]
    bug = verdicts_record({"ngram_gpu": [(Verdict.BUG.label, -20.5)]})
    bug["parameters"].update(engine_environment="v0.32.0-h100", engine_vllm="0.32.0")
    turned = release_findings.gpu_findings(typed_all(changed + [bug]), ledger)[1]
    assert "ngram_gpu (K = 1, 6, 7, 8) wrote plain greedy's tokens in 319 of 320 generations" in turned
    assert "calls 1 of its 1 divergences (first repeats, one per prompt and position) suspected correctness bugs, up to 20.5 logits" in turned
    assert "mtp-v2-k1 (prompt" not in turned and "never in mtp-compiled, mtp-v1-k6" in turned
    for r in changed:
        if r["environments"][0] == "v0.32.0-h100" and r["parameters"]["method"] == "mtp":
            r["results"]["repeats"] = [dict(x, finish_reason="length", output_tokens=96) for x in r["results"]["repeats"]]
    assert "MTP (K = 1, 6, 7, 8) never stopped earlier than plain greedy" in release_findings.gpu_findings(typed_all(changed), ledger)[1]
    assert "on vLLM 0.32.0 (NVIDIA H100 80GB HBM3) ngram_gpu wrote tokens outside the noise band" in release_findings.ngram_advice(typed_all(changed + [bug]))
    assert release_findings.ngram_advice(typed_all(records)).endswith("on vLLM 0.32.0 (NVIDIA H100 80GB HBM3) it wrote plain greedy's tokens every time")


def test_the_first_page_says_why_the_incidents_margin_is_a_tie(reported):
    envs = load_environments()
    mechanism = verdicts_record({"mtp": [(Verdict.NEAR_TIE.label, 0.0)] * 3})
    note = summary.verdict(typed_all(reported + [mechanism]), envs).tie_note
    assert note.startswith("Why a margin of 0.67 logits counts as a tie: the thresholds the classifier used here (0.12 "
                           "logits) are the organism's")
    assert "bf16 moving this very margin by 1.36 logits (reported, record hf-reference-logits-1854)" in note
    agreeing = copy.deepcopy(reported)
    ref = next(r for r in agreeing if r["id"] == summary.REFERENCE_ID)
    bf16 = next(row for row in ref["results"]["rows"] if row["dtype"] == "bf16")
    bf16["logits"], bf16["winner"], bf16["margin"] = {"EOS": 16.2, "DATA": 15.9}, "EOS", 0.3
    assert summary.verdict(typed_all(agreeing), envs).tie_note == ""


def test_the_tie_argument_reads_the_bf16_against_bf16_bands_it_fits():
    """Plain and speculative decoding are both bf16: the sentence places a margin against the recorded bands of the
    order of sums alone, and says inside or outside as the margin and the records say."""
    from spectie.lab.bands import bf16_order_text
    from spectie.records.store import load_records

    records = load_records(chapter="reduction_order")
    assert "a margin of 0.67 lies outside every one of them" in bf16_order_text(0.67, records)
    assert "a margin of 0.05 lies inside the band of" in bf16_order_text(0.05, records)
    assert bf16_order_text(0.67, []) == ""


def test_the_incidents_ngram_gpu_stop_is_read_against_the_ledger(reported):
    from spectie.tools.fixes import ledger_record

    ledger = ledger_record()
    text = release_findings.incident_ngram_text(typed_all(reported), ledger)
    assert text == ("the incident's own ngram_gpu stop (reported, record original-ngram_gpu-wide-verify) ran vLLM "
                    "0.31.0, whose wheel the fix ledger reads as: #40738 (open): lacks it; #52942 (open): lacks it; #56531 (open): lacks it: it may be this correctness bug "
                    "rather than a tie, and these records cannot tell which")
    fixed = copy.deepcopy(ledger.stored)
    for fix in fixed["results"]["fixes"]:
        if fix["fix"].startswith("39273 / PR 56531 (behaviour"):
            fix["per_release"]["0.31.0"] = "present"
    assert "#56531 (open): identifier named in the PR lacks it, behaviour described in the PR has it:" in \
        release_findings.incident_ngram_text(typed_all(reported), typed(fixed))


def test_bullets_keep_a_name_spelled_with_an_inner_capital():
    assert pages.bullets(["vLLM 0.32.0 ran", "speculation by mtp", "ngram_gpu wrote"]) == (
        "- vLLM 0.32.0 ran.\n- Speculation by mtp.\n- ngram_gpu wrote.")


def test_the_incidents_ngram_gpu_release_is_read_against_its_measured_run(reported):
    """When the organism ran ngram_gpu through the incident's own release on a GPU, the sentence says what it did."""
    from spectie.tools.fixes import ledger_record

    verdicts = {"kind": "divergence-verdicts", "provenance": "measured", "environments": ["cpu"],
                "parameters": {"engine_environment": "v0.31.0-h100", "engine_vllm": "0.31.0",
                               "engine_device": "NVIDIA H100 80GB HBM3", "model": "organism", "threshold": 0.118},
                "results": {"rows": [{"class": "ngram_gpu", "verdict": "bug", "fp32_margin": -20.5},
                                     {"class": "ngram_gpu", "verdict": "near-tie", "fp32_margin": 0.01}]}}
    text = release_findings.incident_ngram_text(typed_all(reported + [verdicts]), ledger_record())
    assert ("ran vLLM 0.31.0, whose wheel the fix ledger reads as: #40738 (open): lacks it; #52942 (open): lacks it; #56531 (open): lacks it; on the organism, ngram_gpu of "
            "that release (v0.31.0-h100, measured) wrote tokens outside the noise band: the classifier calls 1 of its "
            "2 divergences suspected correctness bugs, so the bug is in that release: it may be") in text
    verdicts["results"]["rows"] = verdicts["results"]["rows"][1:]
    assert "parted from plain greedy only at near-ties (1 of 1)" in release_findings.incident_ngram_text(typed_all(reported + [verdicts]),
                                                                                                ledger_record())


def test_the_findings_table_has_a_row_per_release_and_path_with_ngram_gpus_silent_stops():
    """The committed GPU records: on 0.26.0 (H200) and 0.31.0 (H100) ngram_gpu K=6 and K=7 stop silently on prompt
    seed 5, after writing tokens the classifier calls a suspected bug; on 0.32.0 ngram_gpu writes plain greedy's
    tokens and MTP K=1 stops at the tie on seed 1. Changed records change the cells."""
    records = load_records()
    rows = {(r["vLLM"], r["path"]): r for r in findings.findings_rows(records)}
    assert {path for _, path in rows} == {"plain greedy", "MTP", "ngram_gpu"}
    for version in ("0.26.0", "0.31.0"):
        ngram = rows[(version, "ngram_gpu")]
        stops = ngram["stopped earlier than plain greedy"]
        assert "ngram_gpu-k6, seed 5: 10 of 10 repeats, after 92 tokens, stop ahead by 0.125" in stops
        assert "ngram_gpu-k7, seed 5: 10 of 10 repeats" in stops and "ngram_gpu-k8" not in stops
        assert ("ngram_gpu-k6, seed 5: yes, parted from plain greedy at output token 21, a suspected bug by the "
                "classifier") in ngram["wrong tokens before that stop"]
        assert "suspected bugs" in ngram["classifier"]
    assert rows[("0.32.0", "ngram_gpu")]["parted from plain greedy"] == "0 of 320"
    assert rows[("0.32.0", "ngram_gpu")]["stopped earlier than plain greedy"] == "never"
    assert "mtp-v1-k1, seed 1: 10 of 10 repeats, after 11 tokens, stop ahead by 0.125" in \
        rows[("0.32.0", "MTP")]["stopped earlier than plain greedy"]
    assert "mtp-v1-k1, seed 1: no, plain greedy's tokens up to the stop" in rows[("0.32.0", "MTP")]["wrong tokens before that stop"]
    # A 0.32.0 MTP run that goes on leaves the cell; no stop, no "wrong tokens" claim.
    changed = [r.stored for r in records if r.kind == "engine-outcome" and r.chapter == "reproduce"]
    changed = copy.deepcopy(changed)
    for r in changed:
        if r["environments"][0] == "v0.32.0-h100" and r["parameters"]["method"] == "mtp":
            r["results"]["repeats"] = [dict(x, finish_reason="length", output_tokens=96) for x in r["results"]["repeats"]]
    turned = {(r["vLLM"], r["path"]): r for r in findings.findings_rows(typed_all(changed))}
    assert turned[("0.32.0", "MTP")]["stopped earlier than plain greedy"] == "never"
    assert turned[("0.32.0", "MTP")]["wrong tokens before that stop"] == ""
    assert turned[("0.26.0", "ngram_gpu")]["classifier"] == "not classified yet"  # no verdict records given


def test_each_speculative_path_gets_its_own_verdict_and_it_turns_with_the_records():
    records = load_records()
    mtp, ngram = findings.path_verdicts(records)
    assert mtp.startswith("**MTP**: a near-tie that speculation took the other way: on vLLM 0.26.0 (NVIDIA H200), "
                          "0.31.0 (NVIDIA H100 80GB HBM3) and 0.32.0 (NVIDIA H100 80GB HBM3), mtp-v1-k1 and mtp-v2-k1 "
                          "on prompt seed 1 (10 of 10 repeats each")
    assert ("**ngram_gpu**: a correctness bug, not a tie, on vLLM 0.26.0 (NVIDIA H200) and 0.31.0 (NVIDIA H100 80GB "
            "HBM3) each") in ngram
    assert "ngram_gpu-k6 and ngram_gpu-k7 on prompt seed 5 (10 of 10 repeats each" in ngram
    assert "on vLLM 0.32.0 (NVIDIA H100 80GB HBM3) it wrote plain greedy's tokens in every generation" in ngram
    # No MTP stop and no verdict records: MTP's verdict no longer says near-tie, ngram_gpu's no longer says bug.
    changed = copy.deepcopy([r.stored for r in records if r.kind == "engine-outcome" and r.chapter == "reproduce"])
    for r in changed:
        if r["parameters"]["method"] == "mtp":
            r["results"]["repeats"] = [dict(x, finish_reason="length", output_tokens=96) for x in r["results"]["repeats"]]
    mtp, ngram = findings.path_verdicts(typed_all(changed))
    assert "near-tie" not in mtp and "never stopped earlier than plain greedy" in mtp
    assert "correctness bug" not in ngram
    assert ("on vLLM 0.26.0 (NVIDIA H200) and 0.31.0 (NVIDIA H100 80GB HBM3), ngram_gpu-k6 and ngram_gpu-k7 on prompt "
            "seed 5") in ngram and "tie or bug is not settled" in ngram


def test_the_classifiers_blind_spot_is_said_from_its_labelled_cases():
    from spectie.tools.divergence_verdicts import CASES_KIND, blind_spot

    def cases(rows, host="x"):
        return typed({"id": f"classifier-cases-cpu-{host}", "kind": CASES_KIND, "chapter": "guidance",
                      "fingerprint": {"host_id": host},
                      "finished_at": "2026-12-07T00:00:00+00:00", "parameters": {"model": "organism", "threshold": 0.1},
                      "results": {"rows": [{"class": c, "truth": t, "right": ok} for c, t, ok in rows]}})

    said = blind_spot([cases([("lost state", "bug", False), ("lost state", "bug", False), ("gate", "bug", True),
                              ("designed tie", "near-tie", True)])])
    assert said.startswith("the classifier caught 1 of 3 planted bugs") and "missed planted bugs of lost state (2 of 2):" in said
    assert "record `classifier-cases-cpu-x`" in said
    assert blind_spot([cases([("gate", "bug", True)])]) == "" and blind_spot([]) == ""
    fewer = cases([("lost state", "bug", False), ("lost state", "bug", False), ("gate", "bug", False)], "y")
    said = blind_spot([cases([("gate", "bug", True), ("lost state", "bug", False)]), fewer])
    assert said.startswith("the classifier caught 0 of 3 planted bugs on its labelled cases as scored on host y, the "
                           "fewest of the 2 hosts that scored them;") and "gate (1 of 1)" in said


def test_one_reason_per_engine_environment_however_many_hosts_classified_it(reported):
    first = verdicts_record({"mtp": [(Verdict.NEAR_TIE.label, 0.0)] * 3})
    second = copy.deepcopy(first)
    second["id"], second["fingerprint"]["host_id"] = "divergence-verdicts-v0-26-0-h200-y", "y"
    because = summary.verdict(typed_all(reported + [first, second]), load_environments()).because
    assert sum("Speculation by mtp through vLLM 0.26.0" in line or "speculation by mtp through vLLM 0.26.0" in line
               for line in because) == 1


def test_the_findings_figure_draws_each_speculative_path_from_the_table_s_counts():
    """One pair of bars per release and speculative path (parted, stopped earlier), their lengths the table's
    counts over the generations; red where the classifier calls the path's divergences suspected bugs."""
    records = load_records()
    figure = findings.findings_figure(records)
    [axes] = figure.axes
    labels = [t.get_text() for t in axes.get_yticklabels()]
    assert "vLLM 0.26.0, H200: ngram_gpu" in labels and "vLLM 0.32.0, H100 80GB HBM3: MTP" in labels
    bars = axes.patches
    assert len(bars) == 2 * len(labels)
    at = {label: (bars[2 * i], bars[2 * i + 1]) for i, label in enumerate(labels)}
    parted, stopped = at["vLLM 0.26.0, H200: ngram_gpu"]
    assert parted.get_width() == pytest.approx(310 / 320) and stopped.get_width() == pytest.approx(20 / 320)
    assert stopped.get_facecolor()[:3] == pytest.approx((0xc4 / 255, 0x4e / 255, 0x52 / 255))  # suspected bugs
    assert at["vLLM 0.32.0, H100 80GB HBM3: ngram_gpu"][0].get_width() == 0  # plain greedy's tokens throughout
    assert findings.findings_figure([r for r in records if not r.measured]) == "No vLLM run on a GPU is recorded."
