"""The thresholds' rules on records written out here: the reference margins, the reported swing's label, the band
of these weights, the bf16 step and the recorded logits, and what the model's threshold is asked with. Expected
values are written out by hand."""

import pytest

from conftest import typed
from spectie.records import fingerprint
from spectie.tools import thresholds
from spectie.tools.thresholds import Reference


def comparison(record_id: str, rows: list[dict], position=None, digest="abc", kind="logit-comparison"):
    record = {"id": record_id, "kind": kind, "chapter": "margins",
              "results": {"rows": rows, **({"position": position} if position is not None else {})}}
    return typed({**record, **({"fingerprint": {"model_sha256": digest}} if digest else {})})


def test_the_reference_signs_the_margins_as_end_of_text_over_its_rival():
    record = comparison("r", [{"dtype": "float32", "winner": "DATA", "logits": {"DATA": 10.0, "EOS": 9.5}},
                              {"dtype": "bfloat16", "winner": "EOS", "logits": {"DATA": 10.0, "EOS": 10.25}}], position=7)
    assert thresholds.reference(record) == Reference(("EOS", "DATA"), -0.5, 0.25, 7, "r")
    assert thresholds.reference(record).swing == 0.75 and thresholds.reference(record).flipped
    record = comparison("s", [{"dtype": "fp32", "winner": "<|endoftext|>", "logits": {"<|endoftext|>": 3.0, "x": 2.0}},
                              {"dtype": "bf16", "winner": "<|endoftext|>", "logits": {"<|endoftext|>": 3.0, "x": 2.5}}])
    assert thresholds.reference(record) == Reference(("<|endoftext|>", "x"), 1.0, 0.5, None, "s")
    assert not thresholds.reference(record).flipped
    record = comparison("t", [{"dtype": "fp32", "winner": "EOS", "logits": {"EOS": 3.0, "DATA": 2.0}},
                              {"dtype": "bf16", "winner": "DATA", "logits": {"EOS": 3.0, "DATA": 3.5}}])
    assert thresholds.reference(record) == Reference(("EOS", "DATA"), 1.0, -0.5, None, "t")


def test_the_reported_swing_says_where_it_is_from():
    record = comparison("ref", [{"dtype": "fp32", "winner": "EOS", "logits": {"EOS": 1.0, "DATA": 0.5}},
                                {"dtype": "bf16", "winner": "DATA", "logits": {"EOS": 1.0, "DATA": 1.25}}])
    assert thresholds.reported_swing(record) == (0.75, (
        "reported: the EOS-DATA margin moved 0.75 logits between the fp32 and bf16 references on the incident's "
        "Qwen3.5 (record ref); no band is recorded for these weights: `make run CHAPTER=reduction_order "
        "MODEL=<model>` records one"))


def test_without_weights_or_records_the_threshold_is_the_reported_swing():
    swing = thresholds.reported_swing()
    assert thresholds.default_threshold(digest="aaaaaaaaaaaa", records=[]) == swing
    assert thresholds.default_threshold(digest=None, records=[]) == swing


def test_the_records_given_are_the_only_band_points_read(monkeypatch):
    from spectie.lab import bands

    points = [{"band": 0.3, "dtype": "bfloat16", "tf32": False, "model_sha256": "aaa", "gpu": None, "label": "x"}]
    monkeypatch.setattr(bands, "recorded_band_points", lambda: points)
    assert thresholds.default_threshold(digest="aaa") == (0.3, "bf16 noise band of x")
    assert thresholds.default_threshold(digest="aaa", records=[]) == thresholds.reported_swing()


def test_a_band_point_of_no_named_weights_is_never_the_band(monkeypatch):
    from spectie.lab import bands

    points = [{"band": 0.3, "dtype": "bfloat16", "tf32": False, "model_sha256": None, "gpu": None, "label": "x"}]
    monkeypatch.setattr(bands, "recorded_band_points", lambda: points)
    assert thresholds.default_threshold(digest=None) == thresholds.reported_swing()


def test_one_bf16_step_is_the_spacing_of_bf16_numbers_at_that_magnitude():
    assert [thresholds.bf16_step(x) for x in (0.0, 1.0, 0.75, 256.0, -256.0)] == [0.0, 0.0078125, 0.00390625, 2.0, 2.0]


def test_the_recorded_logits_are_the_largest_in_magnitude_of_these_weights_comparisons():
    mine = comparison("m", [{"logits": {"EOS": -25.0, "DATA": 3.0}}, {"logits": {"EOS": 24.0}}])
    other_kind = comparison("k", [{"logits": {"EOS": 99.0}}], kind="margin-scan")
    other_weights = comparison("w", [{"logits": {"EOS": 50.0}}], digest="xyz")
    no_fingerprint = comparison("f", [{"logits": {"EOS": 60.0}}], digest=None)
    records = [mine, other_kind, other_weights, no_fingerprint]
    assert thresholds.recorded_logits("abc", records) == (25.0, "m")
    assert thresholds.recorded_logits(None, records) is None
    assert thresholds.recorded_logits("abc", []) is None


def test_without_records_given_the_recorded_logits_are_read_from_the_logit_comparisons(monkeypatch):
    from spectie.records import store as records

    asked = []
    found = [comparison("m", [{"logits": {"EOS": -25.0}}])]
    monkeypatch.setattr(records, "load_records", lambda **kw: asked.append(kw) or found)
    assert thresholds.recorded_logits("abc") == (25.0, "m") and asked == [{"kind": "logit-comparison"}]


def test_a_band_as_wide_as_one_step_is_kept():
    assert thresholds.step_rule(0.125, "band B", (20.0, "m")) == (
        0.125, "band B; wider than one bf16 step (0.125) at the logits recorded for these weights")


def test_the_models_band_is_asked_for_its_weights_on_this_device_unless_told(monkeypatch):
    asked = []
    monkeypatch.setattr(fingerprint, "model_digest", lambda path: f"digest of {path}")
    monkeypatch.setattr(fingerprint, "device_name", lambda: "CPU")
    monkeypatch.setattr(thresholds, "default_threshold", lambda **kw: asked.append(kw) or (0.1, "band X"))
    assert thresholds.threshold_for_model("m") == (0.1, "band X")
    assert thresholds.threshold_for_model("m", device="NVIDIA H100") == (0.1, "band X")
    assert asked == [{"digest": "digest of m", "device": "CPU"}, {"digest": "digest of m", "device": "NVIDIA H100"}]


def test_the_detectors_threshold_is_the_larger_of_the_band_and_one_step_at_these_weights_logits(monkeypatch):
    asked = []
    monkeypatch.setattr(fingerprint, "model_digest", lambda path: f"digest of {path}")
    monkeypatch.setattr(thresholds, "threshold_for_model", lambda path, device: asked.append((path, device)) or
                        (0.1, "band X"))
    monkeypatch.setattr(thresholds, "recorded_logits", lambda digest: (20.0, "m") if digest == "digest of p" else None)
    assert thresholds.detector_threshold_for_model("p", "CPU") == (0.125, (
        "one bf16 step at the logits recorded for these weights (|logit| up to 20.0, record m), wider than the "
        "band X (0.100 logits)"))
    assert thresholds.detector_threshold_for_model("q") == (0.1, "band X")
    assert asked == [("p", "CPU"), ("q", None)]
