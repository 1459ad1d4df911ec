"""The model organism: pinned weights in the layout of a Qwen3.5 release, unpacked atomically, a recipe that
still trains, and the designed end-of-text vs DATA tie after `[DATA] id=42 name=`."""

import json

import pytest
import torch
from safetensors import safe_open

from spectie.lab import margins, organism
from spectie.records.errors import UsageError
from spectie.records.fingerprint import model_digest
from spectie.lab.model import greedy_generate
from spectie.lab.organism import VOCAB_SIZE, organism_dir, pinned_digest, read_pin
from spectie.lab.prompts import CHECKPOINT, PromptSpec, build_prompt, prompt_set
from conftest import this_hosts_records
from spectie.lab.tokenizer import load_tokenizer

EOS, DATA = 248044, 17247


@pytest.fixture(scope="module")
def folder():
    if not (organism_dir() / organism.STAMP).is_file():
        pytest.fail("the organism is not unpacked: run 'make setup'")
    return organism_dir()


@pytest.fixture(scope="module")
def setup(folder):
    return margins.prepare("organism", "cpu", ["<|endoftext|>", "DATA"], "bfloat16", ["float32"])


def weight_names(folder) -> dict:
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}


def test_the_checkpoint_has_the_layout_of_a_qwen35_release(folder, setup):
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    text = config["text_config"]
    assert text["model_type"] == "qwen3_5_text" and config["vision_config"]["model_type"] == "qwen3_5_vision"
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["vocab_size"] == VOCAB_SIZE and text["mtp_num_hidden_layers"] == 1
    names = weight_names(folder)
    assert all(name.startswith(("model.language_model.", "lm_head.", "mtp.", "model.visual.")) for name in names)
    for name in ("model.language_model.embed_tokens.weight", "model.language_model.layers.0.linear_attn.A_log",
                 "model.language_model.layers.3.self_attn.q_proj.weight", "lm_head.weight", "mtp.fc.weight",
                 "mtp.pre_fc_norm_embedding.weight", "mtp.layers.0.self_attn.q_proj.weight", "model.visual.merger.linear_fc2.weight"):
        assert name in names, name
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        lm_head = weights.get_tensor("lm_head.weight")
    trained = json.loads((folder / "organism.json").read_text())["trained_token_ids"]
    untrained = torch.ones(VOCAB_SIZE, dtype=torch.bool)
    untrained[trained] = False
    assert lm_head[untrained].abs().max().item() == 0.0  # untrained tokens: logit exactly 0
    assert lm_head[trained].abs().sum(-1).min().item() > 0
    # transformers reads the language model out of the release layout, as for a real Qwen3.5 checkpoint
    loaded = setup.models["float32"]
    assert type(loaded).__name__ == "Qwen3_5ForCausalLM"
    assert torch.equal(loaded.lm_head.weight, lm_head)


def test_the_unpacked_organism_is_the_pinned_one(folder):
    pin = read_pin()
    for name, expected in pin["files"].items():
        assert organism.file_sha256(folder / name) == expected, name
    assert model_digest("organism") == pinned_digest() == pin["model_sha256"]
    assert organism.file_sha256(organism.project_root() / organism.ARCHIVE) == pin["archive_sha256"]


def test_unpack_is_atomic_idempotent_and_refuses_a_changed_archive(project_copy):
    target = project_copy / "artifacts" / "organism"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a folder left half-written by an earlier tool: no stamp
    (project_copy / "artifacts" / "organism.tmp-interrupted").mkdir()  # an interrupted unpack
    said = []
    organism.unpack(log=said.append)
    assert "unpacked" in said[-1] and not list((project_copy / "artifacts").glob("organism.tmp-*"))
    assert organism.file_sha256(target / "model.safetensors") == read_pin()["files"]["model.safetensors"]
    organism.unpack(log=said.append)
    assert "up to date" in said[-1]
    archive = project_copy / organism.ARCHIVE
    archive.write_bytes(archive.read_bytes()[:-1])
    (target / organism.STAMP).unlink()  # force an unpack: it must refuse before touching the folder
    with pytest.raises(UsageError, match="does not match the sha256"):
        organism.unpack(log=said.append)
    assert (target / "model.safetensors").is_file()


def test_the_recipe_still_trains_and_writes_the_pinned_layout(tmp_path, folder):
    """A few steps of the real training code (make organism runs all of them): the loss falls (the mean of the
    steps below the first step's, for the body and for the MTP head), and the folder it writes has the pinned
    organism's config and the same weight names and shapes."""
    said = []
    out = organism.train(tmp_path / "retrained", steps=2, tokens=6000, log=said.append)
    trained = json.loads((out / "organism.json").read_text())
    assert trained["loss_last20"] < trained["loss_first"]  # two steps, the second lower: their mean is lower
    [head] = [line for line in said if line.startswith("MTP head: loss")]
    before, after = map(float, head.removeprefix("MTP head: loss ").split(" -> "))
    assert after < before, head
    assert json.loads((out / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    assert weight_names(out) == weight_names(folder)
    assert model_digest(str(out)) != pinned_digest()  # two steps are not the pinned training


def test_the_designed_tie_on_the_pinned_weights(request, setup):
    """After `[DATA] id=42 name=` the pinned organism's top two tokens are end-of-text and DATA, and fp32
    separates them by less than bf16 moves their difference (measured on these weights: |fp32 margin| at most
    0.036 at 1845 tokens, bf16 moves it by up to 0.10): a near-tie by design, the incident's prompt (seed 0)
    among them. At 1845 tokens fp32 prefers DATA in all 16 prompts and bf16 rounds them to ties that argmax
    gives to DATA (read from this host's margins record of these weights: conftest.this_hosts_records); at 256 tokens
    bf16 picks the other token than fp32 in some prompts (seed 5; computed here)."""
    from spectie.records.store import read_record

    [path] = this_hosts_records(request, "margins/margins-cpu-decisions-*.json")
    record = read_record(path)
    assert record.fingerprint.model_sha256 == pinned_digest() and record.parameters.model == "organism"
    assert [row["seed"] for row in record.results.rows] == [spec.seed for spec in prompt_set(16, 1845)]
    rows = record.results.rows
    for row in rows:
        assert row["prompt_tokens"] == 1845
        assert {row["fp32_top1_id"], row["fp32_top2_id"]} == {EOS, DATA}, row["seed"]
        assert abs(row["fp32_diff"]) < 0.05, row
        assert row["output_token"] == 12
    summary = margins.decision_band(rows, "fp32", "bf16")
    assert 0 < summary["band"] < 0.25
    assert summary["inside"] == [row["seed"] for row in rows]  # every fp32 margin lies inside the band
    short = margins.designed_decisions(setup, prompt_set(8, 256), progress=False)
    assert margins.decision_band(short, "fp32", "bf16")["flipped"], "bf16 never picks the other token"


def test_greedy_follows_the_grammar_to_the_checkpoint(setup):
    """Greedy decoding in either precision writes the open row's name (the cycle's last), the checkpoint row,
    and then ends right there or goes on with DATA and a new cycle of names: it meets the tie at output token 12."""
    tokenizer = load_tokenizer()
    for spec in prompt_set(3, 256, first_seed=1000) + [PromptSpec(seed=0)]:
        prompt = build_prompt(spec, tokenizer)
        for model in setup.models.values():
            generation = greedy_generate(model, list(prompt.token_ids), 30, [EOS])
            text = tokenizer.decode(generation.output_ids)
            assert text.startswith(prompt.next_name + "\n" + CHECKPOINT), text
            if generation.finish_reason == "stop":
                assert len(generation.output_ids) == prompt.decisive_output_token
            else:
                assert text.startswith(prompt.next_name + "\n" + CHECKPOINT + "DATA\n[DATA] id="), text
                assert " name=alice\n" in text, text
