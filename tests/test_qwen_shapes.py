"""Random-weight Qwen3.5 shapes: the real layouts, memory refusals, and the sweep run end to end on one."""

import pytest

from conftest import typed
from spectie.lab import bands, qwen_shapes, reduction_order, sweeps
from spectie.records.errors import UsageError
from spectie.records.record_types import Record

# A shape small enough for a test, built by the same code as the real ones.
TINY = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
            linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=True)


@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setitem(qwen_shapes.SHAPES, "tiny-shape", TINY)
    return "tiny-shape"


def test_the_four_shapes_have_qwen35_layouts_and_sizes():
    counts = {name: qwen_shapes.parameter_count(name) for name in qwen_shapes.SHAPES}
    assert list(counts.values()) == sorted(counts.values())
    # Published text-tower sizes: 0.8B has 0.75 B text parameters (tied head), 9B 8.95 B (untied).
    assert counts["qwen3.5-0.8b-shape"] == pytest.approx(0.752e9, rel=0.01)
    assert counts["qwen3.5-9b-shape"] == pytest.approx(8.95e9, rel=0.01)
    config = qwen_shapes.config("qwen3.5-9b-shape")
    assert config.layer_types.count("linear_attention") == 24 and config.layer_types[3] == "full_attention"
    assert (config.linear_num_value_heads, config.head_dim, config.vocab_size) == (32, 256, 248320)


def test_a_shape_that_cannot_fit_is_refused_with_the_memory_it_needs(monkeypatch):
    from spectie.lab import memory

    monkeypatch.setattr(memory, "host_memory", lambda: 80 * 2**30)
    # 8.95 B parameters in float64 plus their float32 copy (built in float32, then cast), with memory.SLACK
    with pytest.raises(UsageError, match=r"model 'qwen3.5-9b-shape' needs about 125.\d GiB in float64, only 80.0 GiB"):
        reduction_order.check_plan("cpu", ["bfloat16", "float64"], ["full"], ["torch"], [False], "qwen3.5-9b-shape")
    with pytest.raises(UsageError, match="unknown Qwen3.5 shape"):
        qwen_shapes.config("qwen3.5-7b-shape")


def test_every_precision_gets_the_same_bf16_weights_and_the_chosen_logit_spread(tiny_shape):
    import torch

    ids = list(range(1000, 1100))
    scale = qwen_shapes.logit_scale(tiny_shape, "cpu", ids, logit_std=3.0, seed=7)
    fp32 = qwen_shapes.build(tiny_shape, "float32", "cpu", seed=7, logit_scale=scale)
    bf16 = qwen_shapes.build(tiny_shape, "bfloat16", "cpu", seed=7, logit_scale=scale)
    other = qwen_shapes.build(tiny_shape, "float32", "cpu", seed=8, logit_scale=scale)
    for (name, a), b in zip(fp32.named_parameters(), bf16.parameters()):
        assert torch.equal(a, b.float()), name  # fp32 computes on exactly the weights bf16 serves
    assert not torch.equal(fp32.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert bf16.model.rotary_emb.inv_freq.dtype == torch.float32
    with torch.no_grad():
        hidden = fp32.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        spread = fp32.lm_head(hidden[-qwen_shapes.CALIBRATION_ROWS:]).std(dim=1).mean().item()
    assert spread == pytest.approx(3.0, rel=0.02)


def test_a_sweep_of_a_shape_runs_and_its_record_says_random_weights(tiny_shape):
    result = reduction_order.sweep(tiny_shape, "cpu", ["bfloat16", "float32"], ["full", "decode", "verify-3"],
                               prompt_tokens=200, new_tokens=12, progress=False, weights_seed=3, logit_std=3.0)
    assert result["weights"]["kind"] == sweeps.LABEL and result["weights"]["seed"] == 3
    assert result["model_parameters"] == qwen_shapes.parameter_count(tiny_shape)
    rows = {(r["dtype"], r["shape"]): r for r in result["rows"]}
    assert rows[("float32", "full")]["max_deviation"] == 0.0  # the reference itself
    assert rows[("bfloat16", "decode")]["max_deviation"] > 0.0
    dump = {"parameters": {"model": tiny_shape, "device": "cpu"}, "results": result, "started_at": "t0",
            "finished_at": "t1", "fingerprint": {"host_id": "abc"}}
    record = Record.from_dict(reduction_order.measured_sweep_record(dump, "cpu"))
    assert "random-weight shape" in record.title and record.id == "reduction-order-cpu-tiny-shape-abc"
    assert bands.summary_rows(record)[0]["model"] == "tiny-shape (random weights)"


def test_the_benchmark_times_each_shape_with_the_forwards_it_names(tiny_shape):
    from spectie.lab import bench

    results = bench.run(tiny_shape, "cpu", ["float32"], bench.SHAPES, prompt_tokens=100, new_tokens=8, repeats=1,
                        log=lambda line: None)
    forwards = {row["shape"]: row["forwards"] for row in results["rows"]}
    # A teacher-forced scan is one forward; verify-1 is the prompt and then 2 tokens per forward.
    assert forwards == {"plain forward": 1, "full": 1, "verify-1": 5, "verify-3": 3, "verify-7": 2, "decode": 9}
    assert all(row["seconds"] > 0 and row["tokens_per_s"] > 0 for row in results["rows"])
    assert results["bf16_matmul_flops_per_s"] is None  # measured on GPUs only


def test_the_benchmark_refuses_bad_input_before_loading_anything():
    from spectie.lab import bench

    with pytest.raises(UsageError, match="unknown shape"):
        bench.run("organism", "cpu", ["float32"], ["verify-x"])
    assert bench.main(["--env", "no-such-env"]) == 2


def test_a_shape_written_as_a_release_checkpoint_loads_with_the_same_weights(tiny_shape, tmp_path):
    """The checkpoint the GPU run serves through vLLM: Qwen3.5's release layout (text and vision configs, a
    tied head stored once, an MTP head under `mtp.*`), bf16, and transformers reads back exactly the weights
    `build` makes, so its logits are identical."""
    import json

    import torch
    from safetensors import safe_open

    from spectie.lab.model import load_model

    info = qwen_shapes.write_checkpoint(tiny_shape, str(tmp_path), seed=3)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["text_config"]["mtp_num_hidden_layers"] == 1
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [11, 11, 10]  # Qwen3.5's, for head_dim 256
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
    assert "lm_head.weight" not in names and "model.language_model.embed_tokens.weight" in names
    assert "mtp.fc.weight" in names and "mtp.layers.0.self_attn.q_proj.weight" in names
    assert any(n.startswith("model.visual.") for n in names)
    assert qwen_shapes.model_label(str(tmp_path), str(tmp_path)) == info["label"]
    assert qwen_shapes.is_random_weight_run(typed({"parameters": {"model": info["label"]}}))
    assert not qwen_shapes.is_random_weight_run(typed({"parameters": {"model": "organism"}}))
    loaded = load_model(str(tmp_path), "bfloat16", "cpu")
    built = qwen_shapes.build(tiny_shape, "bfloat16", "cpu", 3, info["logit_scale"])
    ids = torch.arange(100, 300)[None]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, built(input_ids=ids).logits)
        assert loaded(input_ids=ids).logits.float().std().item() == pytest.approx(3.0, rel=0.2)


def test_an_unknown_shape_is_refused_before_a_checkpoint_is_written(tmp_path):
    with pytest.raises(UsageError, match="unknown Qwen3.5 shape"):
        qwen_shapes.write_checkpoint("qwen3.5-7b-shape", str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
