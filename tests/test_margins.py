"""Margins: teacher-forced logits equal step-by-step logits; tables, curves and bad input."""

import json

import pytest
import torch

from spectie.lab import margins
from spectie.records.errors import UsageError
from spectie.lab.model import (GDN_FUNCTIONS, Generation, greedy_generate, load_model, reference_gdn_kernels, stepwise_logits,
                           teacher_forced_logits)
from spectie.lab.organism import organism_dir
from spectie.lab.prompts import PromptSpec, build_prompt
from spectie.records.record_types import DesignedDecisions


@pytest.fixture(scope="module")
def organism():
    if not (organism_dir() / "model.safetensors").is_file():
        pytest.fail("the organism is not built: run 'make setup'")
    return str(organism_dir())


# transformers computes RMSNorm and the GDN rules in fp32 even for an fp64 model: hence 1e-5, not 1e-12.
@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-5), ("float32", 2e-3)])
def test_teacher_forcing_matches_step_by_step_decoding(organism, dtype, tolerance):
    """One forward over prompt+continuation (GDN's chunked rule) gives the logits that decoding token
    by token with the cache (GDN's recurrent rule) gives, up to the dtype's rounding."""
    from spectie.lab.tokenizer import load_tokenizer

    model = load_model(organism, dtype)
    prompt = build_prompt(PromptSpec(tokens=150, seed=3), load_tokenizer())
    generation = greedy_generate(model, list(prompt.token_ids), 20, [248044])
    positions = [generation.position(i) for i in range(len(generation.output_ids))]
    forced = teacher_forced_logits(model, generation.ids, positions)
    stepped = stepwise_logits(model, generation.ids, positions)
    assert forced.shape == stepped.shape == (len(positions), 248320)
    assert (forced - stepped).abs().max().item() < tolerance
    # and greedy decoding picked the top-1 of those logits at every position
    assert forced.argmax(-1).tolist() == generation.output_ids


def _fake_logits(values_by_dtype):
    out = {}
    for dtype, rows in values_by_dtype.items():
        tensor = torch.full((len(rows), 6), -5.0, dtype=torch.float64)
        for i, row in enumerate(rows):
            for token, value in row.items():
                tensor[i, token] = value
        out[dtype] = tensor
    return out


def test_position_table_and_decisive_comparison():
    logits = _fake_logits({
        "float64": [{0: 3.0, 1: 1.0}, {4: 2.0, 5: 1.9}],
        "bfloat16": [{0: 3.0, 1: 1.0}, {4: 1.875, 5: 2.0}],
    })
    rows = margins.position_table(logits, [10, 11], {"EOS": 4, "ROW": 5}, decode=str)
    assert rows[0]["top1_disagree"] is False and rows[1]["top1_disagree"] is True
    assert rows[1]["fp64_diff"] == pytest.approx(0.1) and rows[1]["bf16_diff"] == pytest.approx(-0.125)
    assert rows[1]["fp64_margin"] == pytest.approx(0.1)
    generation = Generation([7] * 10, [0, 4], "stop")
    measurement = margins.PromptMeasurement(generation, [10, 11], rows, "fp64")
    assert measurement.decisive_index == 1
    decisive = margins.decisive_comparison(measurement, {"EOS": 4, "ROW": 5})
    assert decisive["position"] == 11
    assert [(r["dtype"], r["winner"]) for r in decisive["rows"]] == [("fp64", "EOS"), ("bf16", "ROW")]
    assert margins.flip_pairs(measurement, "fp64", "bf16") == [(2.0, False), (pytest.approx(0.1), True)]


def test_flip_curve_counts_and_bf16_spacing():
    bins = margins.flip_curve([(0.01, True), (0.03, False), (0.04, True), (3.0, False)], [0, 0.02, 0.05, 1, 10])
    assert [(b["count"], b["flips"]) for b in bins] == [(1, 1), (2, 1), (0, 0), (1, 0)]
    assert bins[2]["flip_rate"] is None and bins[1]["flip_rate"] == 0.5
    assert margins.bf16_spacing(16.47) == 0.125
    assert margins.bf16_spacing(15.8) == 0.0625
    # the spacing really is the gap between adjacent bf16 numbers
    x = torch.tensor(16.47, dtype=torch.bfloat16)
    assert torch.nextafter(x, torch.tensor(100.0, dtype=torch.bfloat16)).item() - x.item() == 0.125


def test_bad_input_is_refused_before_loading_weights(tmp_path, organism):
    with pytest.raises(UsageError, match="neither a folder"):
        margins.prepare("no/such/dir/here", "cpu", ["<|endoftext|>", "DATA"], "bfloat16", ["float32"])
    with pytest.raises(UsageError, match="no CUDA GPU"):
        margins.prepare(organism, "cuda", ["<|endoftext|>", "DATA"], "bfloat16", ["float32"])
    with pytest.raises(UsageError, match="unknown dtype 'float8'"):
        margins.prepare(organism, "cpu", ["<|endoftext|>", "DATA"], "float8", ["float32"])
    with pytest.raises(UsageError, match="no single token 'DATA row'"):
        margins.prepare(organism, "cpu", ["<|endoftext|>", "DATA row"], "bfloat16", ["float32"])
    vit = tmp_path / "vit"
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    with pytest.raises(UsageError, match="not a causal language model"):
        margins.prepare(str(vit), "cpu", ["<|endoftext|>", "DATA"], "bfloat16", ["float32"])


def test_reference_gdn_kernels_swap_in_the_torch_code_and_restore_the_wrappers():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as module

    before = {name: getattr(module, name) for name in GDN_FUNCTIONS}
    assert all(hasattr(f, "__wrapped__") for f in before.values())  # transformers' dispatching wrappers
    with reference_gdn_kernels():
        for name in GDN_FUNCTIONS:
            function = getattr(module, name)
            assert not hasattr(function, "__wrapped__") and function.__module__ == module.__name__
    assert {name: getattr(module, name) for name in GDN_FUNCTIONS} == before


def test_decision_band_and_text_follow_the_rows():
    """The band is the largest move of the pair's difference; a decision is inside it when its reference
    margin is smaller; a bf16 tie goes to the lower token id, as argmax does (DATA 17247 < EOS 248044)."""
    watch = {"EOS": 248044, "DATA": 17247}

    def row(seed, ref, bf16):
        return {"seed": seed, "fp32_diff": ref, "bf16_diff": bf16,
                "fp32_winner": margins.pair_winner(ref, 0.0, watch), "bf16_winner": margins.pair_winner(bf16, 0.0, watch)}

    rows = [row(0, -0.03, 0.0), row(1, 0.01, 0.0), row(2, -0.2, -0.25), row(3, 0.3, 0.25)]
    summary = margins.decision_band(rows, "fp32", "bf16")
    assert summary["band"] == pytest.approx(0.05) and summary["inside"] == [0, 1] and summary["flipped"] == [1]
    text = margins.decision_text(rows, DesignedDecisions.from_dict(summary), "fp32", "bf16", 0)
    assert text == ("fp32 picks DATA or EOS there (DATA in 2, EOS in 2); 2 of 4 fp32 margins lie inside the band; "
                    "the first prompt's (seed 0) fp32 margin of 0.030 is inside it; bf16 picks the other token than fp32 "
                    "in 1 of 4 prompts (seeds 1): the precision alone decides between stopping and going on")
    calm = [row(0, -0.2, -0.25), row(1, 0.3, 0.25)]
    calm_summary = DesignedDecisions.from_dict(margins.decision_band(calm, "fp32", "bf16"))
    assert margins.decision_text(calm, calm_summary, "fp32", "bf16", 0).endswith(
        "0 of 2 fp32 margins lie inside the band; the first prompt's (seed 0) fp32 margin of 0.200 is outside it; "
        "bf16 and fp32 pick the same token in every one of them")
    assert margins.pair_winner(1.0, 1.0, watch) == "DATA" and margins.pair_winner(1.0, 0.5, watch) == "EOS"


def test_an_exact_tie_ranks_the_lower_token_id_first_as_greedy_decoding_does():
    row = torch.full((300000,), -3.0, dtype=torch.bfloat16)
    row[248044] = row[17247] = 20.0  # EOS and DATA rounded to the same bf16 value
    values, ids = margins.top_two(row.double())
    assert ids.tolist() == [17247, 248044] == [int(row.argmax()), 248044] and values.tolist() == [20.0, 20.0]
    [entry] = margins.position_table({"bfloat16": row.double()[None]}, [5], {"EOS": 248044, "DATA": 17247}, str)
    assert entry["bf16_top1_id"] == 17247 and entry["bf16_winner"] == "DATA" and entry["bf16_margin"] == 0.0
