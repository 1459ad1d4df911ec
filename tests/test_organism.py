"""The model organism: a Qwen3.5-architecture checkpoint with an MTP head, trained to tie EOS with
the next row at the end of some rows."""

import json
import math

import pytest
import torch
from safetensors import safe_open

from spectie import margins
from spectie.organism import END_PROBABILITY, VOCAB_SIZE, organism_dir
from spectie.prompts import NAMES, PromptSpec, build_prompt, prompt_set
from spectie.tokenizer import load_tokenizer

EOS = 248044


@pytest.fixture(scope="module")
def folder():
    if not (organism_dir() / "model.safetensors").is_file():
        pytest.fail("the organism is not built: run 'make setup'")
    return organism_dir()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def fp32(folder):
    return margins.load_model(str(folder), "float32")


def test_the_checkpoint_is_qwen35_with_an_mtp_head(folder, fp32):
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["vocab_size"] == VOCAB_SIZE and config["mtp_num_hidden_layers"] == 1
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        lm_head = weights.get_tensor("lm_head.weight")
    for name in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                 "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"):
        assert name in names, name
    trained = json.loads((folder / "organism.json").read_text())["trained_token_ids"]
    untrained = torch.ones(VOCAB_SIZE, dtype=torch.bool)
    untrained[trained] = False
    assert lm_head[untrained].abs().max().item() == 0.0  # untrained tokens: logit exactly 0
    assert lm_head[trained].abs().sum(-1).min().item() > 0
    assert type(fp32).__name__ == "Qwen3_5ForCausalLM"


def test_the_eos_decision_follows_the_training_rule(fp32, tokenizer):
    """After each row, logit(EOS) − logit('[') tracks the log-odds of the listing's stopping rule."""
    bracket = tokenizer.convert_tokens_to_ids("[")
    prompt = build_prompt(PromptSpec(tokens=400, seed=5), tokenizer)
    ids = list(prompt.token_ids)
    with torch.no_grad():
        logits = fp32(input_ids=torch.tensor([ids])).logits[0].double()
    by_name = {}
    for i in range(1, len(ids) - 1):
        if tokenizer.decode([ids[i]]) == "\n":
            name = tokenizer.decode([ids[i - 1]])
            by_name.setdefault(name, []).append(float(logits[i, EOS] - logits[i, bracket]))
    assert set(by_name) == set(NAMES)
    for name, diffs in by_name.items():
        p = END_PROBABILITY[name]
        mean = sum(diffs) / len(diffs)
        if p == 0:
            assert mean < -4, (name, mean)
        else:
            assert abs(mean - math.log(p / (1 - p))) < 0.4, (name, p, mean)


def test_greedy_continuations_end_with_eos_at_a_row_boundary(fp32, tokenizer):
    stops = 0
    for spec in prompt_set(6, 256, first_seed=1000):
        generation = margins.greedy_generate(fp32, list(build_prompt(spec, tokenizer).token_ids), 96, [EOS])
        if generation.finish_reason == "stop":
            stops += 1
            assert tokenizer.decode(generation.output_ids[:-1]).endswith("\n")  # the EOS follows a full row
    assert stops >= 1


def test_bf16_moves_eos_decisions_and_flips_some_decisions_on_the_default_prompts(folder, fp32, tokenizer):
    """On the chapter's default sweep prompts (teacher-forced on the bf16 continuation), bf16 picks another
    top-1 than fp32 at some positions, and at the EOS decisions it moves the EOS-vs-'[' difference by up to
    its rounding. Whether one of those EOS decisions lies close enough to a tie to flip depends on the
    trained weights, which differ between CPU types (measured: flips on one, none in 40 prompts on another),
    so that is what the margins chapter reports, not what this test requires."""
    bf16 = margins.load_model(str(folder), "bfloat16")
    watch = {"EOS": EOS, "[": tokenizer.convert_tokens_to_ids("[")}
    flips, shifts = 0, []
    for spec in prompt_set(10, 256, first_seed=1000):
        measurement = margins.measure_prompt({"float32": fp32, "bfloat16": bf16}, "bfloat16",
                                             list(build_prompt(spec, tokenizer).token_ids), 48, [EOS], watch, str)
        flips += sum(flipped for _, flipped in margins.flip_pairs(measurement, "fp32", "bf16"))
        shifts += [abs(row["bf16_diff"] - row["fp32_diff"])
                   for row in margins.eos_decisions(measurement, "fp32", [EOS])]
    assert flips >= 1, "bf16 and fp32 agree on every top-1 of 10 sweep prompts"
    assert shifts and 0 < max(shifts) < 0.5, shifts
