"""Divergence classifier on the organism: a planted state bug, identical pairs, bad input, the command line."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT
from spectie import divergence
from spectie.errors import UsageError
from spectie.reproduce import first_divergence


@pytest.fixture(scope="module")
def organism_runs():
    """The organism's prompt, its plain bf16 greedy output, and the output of the same decoding with a
    planted bug (GDN states read from an empty slot from the first output token on)."""
    from spectie.guidance import planted_bug

    return planted_bug("organism")


def test_a_planted_state_bug_is_a_suspected_bug(organism_runs):
    prompt, plain, buggy = organism_runs
    assert buggy != plain
    result = divergence.classify("organism", prompt, buggy, plain)
    assert result.verdict == divergence.SUSPECTED_BUG, result.explanation
    assert result.position == first_divergence(buggy, plain)
    assert abs(result.reference_margin) > result.threshold or result.outside_band_a
    assert result.outside_band_a and not result.outside_band_b  # the buggy run strays; plain bf16 does not
    assert "organism" in result.threshold_origin


def test_identical_sequences_are_said_to_be_identical(organism_runs):
    prompt, plain, _ = organism_runs
    result = divergence.classify("organism", prompt, plain, plain)
    assert result.verdict == divergence.IDENTICAL and "identical" in result.explanation
    assert divergence.classify("organism", prompt, plain[:5], plain).verdict == divergence.IDENTICAL


def test_bad_input_is_refused_before_any_model_loads():
    with pytest.raises(UsageError, match="outside the model's vocabulary"):
        divergence.classify("organism", [1, 2], [3, 10**7], [3, 4])
    with pytest.raises(UsageError, match="list of token ids"):
        divergence.classify("organism", [1, 2], ["a"], [3])
    with pytest.raises(UsageError, match="threshold"):
        divergence.classify("organism", [1, 2], [3], [4], threshold=-1.0)


def test_the_command_line_classifies_a_pair_file(organism_runs, tmp_path):
    prompt, plain, buggy = organism_runs
    run = lambda *args: subprocess.run([sys.executable, "-m", "spectie", "classify", *args], cwd=ROOT,
                                       capture_output=True, text=True)
    same = tmp_path / "same.json"
    same.write_text(json.dumps({"prompt_token_ids": prompt, "a": plain, "b": plain}))
    result = run(str(same))
    assert result.returncode == 0 and "identical" in result.stdout, result.stderr
    bug = tmp_path / "bug.json"
    bug.write_text(json.dumps({"prompt_token_ids": prompt, "a": buggy, "b": plain, "model": "organism"}))
    result = run(str(bug), "--json", "--fail-on-bug")
    assert result.returncode == 1 and json.loads(result.stdout)["verdict"] == divergence.SUSPECTED_BUG
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"a": [1]}))
    result = run(str(broken))
    assert result.returncode == 2 and "missing prompt_token_ids, b" in result.stderr
    assert run("--help").returncode == 0


def test_the_baseline_beside_a_record_is_the_one_of_its_prompt_seed(tmp_path):
    import json
    from pathlib import Path

    from spectie.divergence import baseline_record

    folder = Path(__file__).resolve().parent.parent / "results/measured/v0.26.0-h200-5bce98f73f3e/reproduce"
    plain = {seed: json.loads(next(folder.glob(f"*-plain-s{seed}-*.json")).read_text()) for seed in (0, 1)}
    for seed, record in plain.items():
        (tmp_path / f"plain-s{seed}.json").write_text(json.dumps(record))
    other = json.loads(json.dumps(plain[1]))
    other["id"], other["parameters"]["configuration"] = "spec-s1", "spec"
    (tmp_path / "spec-s1.json").write_text(json.dumps(other))
    assert baseline_record(tmp_path / "spec-s1.json")["parameters"]["prompt_seed"] == 1
