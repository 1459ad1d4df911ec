"""The reproduction matrix as data: validation before any engine starts, and vLLM arguments."""

import pytest

from spectie.records.errors import UsageError
from spectie.engines.matrix import load_matrix, read_matrix


def test_the_incident_matrix_expands_per_k_and_maps_to_vllm_arguments():
    configs = {c.id: c for c in load_matrix()}
    # The incident's configurations: both runners with K in {1, 6, 7, 8} (the title's claim is K >= 7).
    assert {"plain", "plain-no-prefix-cache", "mtp-compiled", "mtp-no-prefix-cache-k3",
            "plain-batch-invariant"} | {f"{m}-k{k}" for m in ("ngram_gpu", "mtp-v1", "mtp-v2")
                                         for k in (1, 6, 7, 8)} <= set(configs)
    assert all(c.max_tokens == 96 and c.temperature == 0 for c in configs.values())
    repeats = {c.id: c.repeats for c in configs.values()}
    assert repeats["mtp-compiled"] == 33 and repeats["mtp-v2-k7"] == 10 and repeats["plain"] == 10
    # vLLM refuses batch-invariant mode for GDN attention: that configuration is marked as an expected refusal.
    assert {c.id for c in configs.values() if c.expect == "refused"} == {"plain-batch-invariant"}
    kwargs = configs["mtp-v2-k8"].llm_kwargs("organism", "bfloat16", kv_cache_memory_bytes=1 << 28)
    assert kwargs["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 8}
    assert kwargs["enforce_eager"] is True and kwargs["kv_cache_memory_bytes"] == 1 << 28
    assert configs["mtp-v2-k8"].environment() == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert configs["ngram_gpu-k7"].environment() == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    compiled = configs["mtp-compiled"].llm_kwargs("m", "bfloat16")
    assert compiled["enforce_eager"] is False and compiled["compilation_config"] == {"cudagraph_mode": "NONE"}
    assert "speculative_config" not in configs["plain"].llm_kwargs("m", "bfloat16")
    assert configs["plain-batch-invariant"].environment() == {"VLLM_BATCH_INVARIANT": "1"}


@pytest.mark.parametrize("entry, message", [
    ("{id: a, method: beam}", "unknown method 'beam'; valid: none, ngram, ngram_gpu, mtp"),
    ("{id: a, method: mtp, k: 0}", "must be an integer >= 1, got 0"),
    ("{id: a, method: mtp, k: [1, -2]}", "must be an integer >= 1, got -2"),
    ("{id: a, method: none, k: 3}", "method 'none' takes no k"),
    ("{id: a, method: mtp, k: 1, speculative: yes}", "unknown field(s) speculative"),
    ("{id: a, method: mtp, k: 1, model_runner: V3}", "model_runner must be V1, V2 or null"),
    ("{method: mtp, k: 1}", "needs an id"),
    ("{id: a, method: none, expect: fail}", "expect must be one of ok, refused, crashed, ok-or-crashed"),
])
def test_bad_configurations_are_refused_with_the_reason(tmp_path, entry, message):
    path = tmp_path / "m.yaml"
    path.write_text("defaults: {temperature: 0, max_tokens: 96, repeats: 2, enforce_eager: true, "
                    f"enable_prefix_caching: false}}\nconfigurations:\n  - {entry}\n")
    with pytest.raises(UsageError, match="m.yaml: configuration") as info:
        load_matrix(path)
    assert message in str(info.value)


def test_bad_matrix_files(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_matrix(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("configurations: [\n")
    with pytest.raises(UsageError, match="does not parse"):
        load_matrix(tmp_path / "broken.yaml")
    (tmp_path / "twice.yaml").write_text(
        "defaults: {temperature: 0, max_tokens: 9, repeats: 1, enforce_eager: true, enable_prefix_caching: false}\n"
        "configurations:\n  - {id: a, method: mtp, k: [1]}\n  - {id: a, method: none}\n")
    with pytest.raises(UsageError, match="'a' is used twice"):
        load_matrix(tmp_path / "twice.yaml")


def test_with_repeats_overrides_every_configuration_or_refuses_a_bad_count():
    matrix = read_matrix("cpu")
    assert {c.repeats for c in matrix.with_repeats(3).configs} == {3}
    assert matrix.with_repeats(None) is matrix
    for bad in (0, -1, "3", True, 2.5):
        with pytest.raises(UsageError, match="repeats must be an integer >= 1"):
            matrix.with_repeats(bad)


def test_every_matrix_bounds_the_context_and_fits_the_incident_prompt(tmp_path):
    for name in ("incident", "cpu"):
        matrix = read_matrix(name)
        assert matrix.engine["max_model_len"] >= 1845 + 96
        matrix.check_fits(1845)
    with pytest.raises(UsageError, match="need max_model_len >= 4097, it is 4096"):
        read_matrix("incident").check_fits(4001)
    path = tmp_path / "open.yaml"  # no max_model_len: the KV cache would be sized for the whole context
    path.write_text("defaults: {temperature: 0, max_tokens: 9, repeats: 1, enforce_eager: true, "
                    "enable_prefix_caching: false}\nconfigurations:\n  - {id: a, method: none}\n")
    with pytest.raises(UsageError, match="sets no engine max_model_len"):
        read_matrix(path).check_fits(100)


def test_parallel_and_engine_environment_overrides():
    matrix = read_matrix("incident")
    assert matrix.with_parallel(None) is matrix and matrix.with_parallel(3).parallel == 3
    for bad in (0, "2", True):
        with pytest.raises(UsageError, match="parallel must be an integer >= 1"):
            matrix.with_parallel(bad)
    assert matrix.with_environment({"VLLM_USE_FLASHINFER_SAMPLER": 0}).environment["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    read_matrix("incident").check_fits(5000, {"max_model_len": 8192})  # an engine argument can widen it


def test_max_tokens_and_ignore_eos_reach_sampling_params_and_bad_values_are_refused():
    matrix = read_matrix("incident").with_sampling(max_tokens=256, ignore_eos=True)
    assert {c.sampling_kwargs()["max_tokens"] for c in matrix.configs} == {256}
    assert all(c.sampling_kwargs()["ignore_eos"] is True for c in matrix.configs)
    assert "ignore_eos" not in read_matrix("incident").configs[0].sampling_kwargs()  # vLLM's default unless asked
    assert read_matrix("incident").with_sampling() == read_matrix("incident")
    with pytest.raises(UsageError, match="max_tokens must be an integer"):
        read_matrix("incident").with_sampling(max_tokens=0)
    with pytest.raises(UsageError, match="ignore_eos must be true or false"):
        read_matrix("incident").with_sampling(ignore_eos="yes")
