"""The GPU path, on a CUDA device (pytest marker `gpu`; skipped where no CUDA device is present).

    .venv/bin/python -m pytest -m gpu tests/test_gpu.py

The organism in transformers on CUDA against the CPU's float64 reference; flash-linear-attention's GDN
kernels against transformers' torch reference code; a random-weight Qwen3.5 shape on the GPU; and a
two-configuration matrix (plain greedy and MTP) through the real CUDA vLLM of the environment
`v0.26.0-h200` (its interpreter: `make venv ENV=v0.26.0-h200`), with a small max_tokens.
"""

import importlib.util
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")]

GPU_ENVIRONMENT = "v0.26.0-h200"


@pytest.fixture(scope="module")
def organism():
    from spectie.lab.model import resolve_model
    from spectie.lab.prompts import PromptSpec, build_prompt
    from spectie.lab.tokenizer import model_tokenizer

    path = resolve_model("organism")
    prompt = build_prompt(PromptSpec(tokens=1845, seed=0).check(), model_tokenizer(str(path)))
    return path, prompt


def decision_logits(path, prompt, dtype, device, kernels="torch"):
    """Logits of the designed decision (the prompt's last position) in `dtype` on `device`."""
    from spectie.lab.model import load_model, teacher_forced_logits
    from spectie.lab.reduction_order import kernel_context

    model = load_model(path, dtype, device)
    with kernel_context(kernels):
        logits = teacher_forced_logits(model, list(prompt.token_ids), [len(prompt.token_ids)])[0]
    del model
    torch.cuda.empty_cache()
    return logits


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_the_organism_on_cuda_matches_the_cpu_reference(organism):
    path, prompt = organism
    reference = decision_logits(path, prompt, "float64", "cpu")
    on_gpu = decision_logits(path, prompt, "float32", "cuda")
    error = relative_error(on_gpu, reference)
    print(f"organism fp32 on CUDA vs fp64 on CPU at the decision: relative error {error:.2e}")
    assert error < 1e-4  # fp32 arithmetic with TF32 off
    bf16 = decision_logits(path, prompt, "bfloat16", "cuda")
    assert relative_error(bf16, reference) < 2e-2  # bf16 weights and activations


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention is not installed")
def test_fla_kernels_agree_with_transformers_torch_reference(organism):
    path, prompt = organism
    reference = decision_logits(path, prompt, "float32", "cuda", kernels="torch")
    fla = decision_logits(path, prompt, "float32", "cuda", kernels="fla")
    error = relative_error(fla, reference)
    print(f"organism fp32 with fla's GDN kernels vs transformers' torch GDN code: relative error {error:.2e}")
    assert 0 < error < 1e-2  # different kernels (fla's Triton dots use TF32): close, not identical


def test_a_random_weight_qwen35_shape_runs_on_the_gpu():
    from spectie.lab import qwen_shapes

    model = qwen_shapes.build("qwen3.5-0.8b-shape", "bfloat16", "cuda", seed=0)
    ids = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 512, model.config.vocab_size) and torch.isfinite(logits).all()
    del model
    torch.cuda.empty_cache()


def test_plain_and_mtp_through_cuda_vllm(organism, tmp_path):
    """The product path on a GPU: the incident's matrix (two configurations, 24 new tokens) through the
    environment's own CUDA vLLM, records written and valid."""
    from spectie.engines import checks, matrix_run
    from spectie.records.environments import get_environment
    from spectie.engines.matrix import read_matrix
    from spectie.records.store import validate_record
    from spectie.engines.checks import check_installed

    if not checks.engine_python(GPU_ENVIRONMENT).exists():
        pytest.skip(f"no .venvs/{GPU_ENVIRONMENT} (make venv ENV={GPU_ENVIRONMENT})")
    path, prompt = organism
    env = get_environment(GPU_ENVIRONMENT)
    matrix = read_matrix("incident").select(["mtp-v2-k1"]).with_repeats(2).with_parallel(2)
    matrix = replace(matrix, configs=tuple(replace(c, max_tokens=24) for c in matrix.configs))
    matrix = matrix.with_environment(env["engine_environment"])
    extra = {**env["engine"], "kv_cache_memory_bytes": 1 << 30, "gpu_memory_utilization": 0.4}
    probe = checks.probe_vllm(GPU_ENVIRONMENT)
    check_installed(env, probe)
    checks.check_matrix(matrix, probe, extra)
    records = matrix_run.run_matrix(matrix, path, {0: list(prompt.token_ids)}, GPU_ENVIRONMENT, probe, "0" * 64,
                                   extra_engine=extra, model_label="organism", progress=False, results_dir=tmp_path)
    plain, mtp = (r.results for r in records)
    for record in records:
        validate_record(record.stored)
        assert record.fingerprint.gpu.startswith("NVIDIA") and record.fingerprint.vllm == "0.26.0"
    for results in (plain, mtp):
        assert results.status == "ok" and results.runs_total == 2 and results.backend == "cuda"
        repeat = results.repeats[0]
        assert repeat["token_ids"][prompt.decisive_output_token - 1] in (248044, 17247)  # EOS or DATA
        assert len(repeat["top2_margins"]) == repeat["output_tokens"]
    assert mtp.model_runner_used == "V2" and mtp.repeats[0]["speculation"]["num_draft_tokens"] > 0
