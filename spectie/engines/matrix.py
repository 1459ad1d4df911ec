"""The reproduction chapter's configuration matrix: engine configurations as data (YAML), checked
before any engine starts, and turned into vLLM's public `LLM(...)` arguments.

A matrix file has `defaults` (per-configuration fields), `engine` (engine arguments every
configuration shares, e.g. `dtype` or the CPU backend's `kv_cache_memory_bytes`), `environment`
(environment variables every engine process gets), `baseline` (the id every configuration is
compared with) and `configurations`. spectie.engines.matrix_run runs it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from spectie.records.errors import UsageError, read_yaml

METHODS = ("none", "ngram", "ngram_gpu", "mtp")
MODEL_RUNNERS = (None, "V1", "V2")
FIELDS = {"id", "method", "k", "temperature", "max_tokens", "repeats", "enforce_eager", "enable_prefix_caching",
          "model_runner", "cudagraph_mode", "batch_invariant", "expect", "ignore_eos"}
# refused / crashed: vLLM is known to refuse this configuration, or to crash on it on this backend (kept in the
# matrix to record it; a run that does otherwise is flagged as not as expected)
# ok-or-crashed: the outcome depends on the host (its CPU's numerics change what the engine meets); either is expected.
EXPECTED_STATUSES = {"ok": ("ok",), "refused": ("unsupported",), "crashed": ("crashed",),
                     "ok-or-crashed": ("ok", "crashed")}
EXPECTATIONS = tuple(EXPECTED_STATUSES)
MATRICES = Path(__file__).with_name("matrices")


@dataclass(frozen=True)
class EngineConfig:
    id: str
    method: str
    k: int | None  # num_speculative_tokens; None without speculation
    temperature: float
    max_tokens: int
    repeats: int
    enforce_eager: bool
    enable_prefix_caching: bool
    model_runner: str | None = None
    cudagraph_mode: str | None = None
    batch_invariant: bool = False
    expect: str = "ok"  # "refused" / "crashed" / "ok-or-crashed": to record vLLM's known refusal or crash
    ignore_eos: bool = False  # generate max_tokens whatever the model writes (random weights: no designed stop)

    def llm_kwargs(self, model: str, dtype: str, **extra) -> dict:
        """Keyword arguments of `vllm.LLM` for this configuration (`extra`: shared engine arguments)."""
        kwargs = dict(model=model, dtype=dtype, seed=0, **extra)
        kwargs.update(enforce_eager=self.enforce_eager, enable_prefix_caching=self.enable_prefix_caching)
        if self.method != "none":
            kwargs["speculative_config"] = {"method": self.method, "num_speculative_tokens": self.k}
        if self.cudagraph_mode is not None:
            kwargs["compilation_config"] = {"cudagraph_mode": self.cudagraph_mode}
        return kwargs

    def environment(self) -> dict[str, str]:
        """Environment variables the engine process needs for this configuration."""
        env = {}
        if self.model_runner is not None:
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if self.model_runner == "V2" else "0"
        if self.batch_invariant:
            env["VLLM_BATCH_INVARIANT"] = "1"
        return env

    def sampling_kwargs(self) -> dict:
        """Keyword arguments of `vllm.SamplingParams`; top-2 logprobs give each token's margin over the
        runner-up (the tie-stop detector reads the stop token's)."""
        kwargs = {"temperature": self.temperature, "max_tokens": self.max_tokens, "logprobs": 2}
        if self.ignore_eos:
            kwargs["ignore_eos"] = True
        return kwargs

    def describe(self) -> dict:
        return asdict(self)


def _check(entry: dict, where: str) -> None:
    unknown = sorted(set(entry) - FIELDS)
    if unknown:
        raise UsageError(f"{where}: unknown field(s) {', '.join(unknown)}; valid: {', '.join(sorted(FIELDS))}")
    if entry.get("method") not in METHODS:
        raise UsageError(f"{where}: unknown method {entry.get('method')!r}; valid: {', '.join(METHODS)}")
    if entry.get("expect", "ok") not in EXPECTATIONS:
        raise UsageError(f"{where}: expect must be one of {', '.join(EXPECTATIONS)}, got {entry.get('expect')!r}")
    if entry.get("model_runner") not in MODEL_RUNNERS:
        raise UsageError(f"{where}: model_runner must be V1, V2 or null, got {entry.get('model_runner')!r}")
    k = entry.get("k")
    if entry["method"] == "none":
        if k is not None:
            raise UsageError(f"{where}: method 'none' takes no k")
    else:
        for value in k if isinstance(k, list) else [k]:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"{where}: k (num_speculative_tokens) must be an integer >= 1, got {value!r}")
    if not isinstance(entry.get("ignore_eos", False), bool):
        raise UsageError(f"{where}: ignore_eos must be true or false, got {entry.get('ignore_eos')!r}")
    for field in ("max_tokens", "repeats"):
        if not isinstance(entry.get(field), int) or entry[field] < 1:
            raise UsageError(f"{where}: {field} must be an integer >= 1, got {entry.get(field)!r}")


@dataclass(frozen=True)
class Matrix:
    name: str
    path: str
    configs: tuple[EngineConfig, ...]
    baseline: str | None  # id of the configuration every other one is compared with
    engine: dict = field(default_factory=dict)  # engine arguments shared by every configuration
    environment: dict = field(default_factory=dict)  # environment variables of every engine process
    parallel: int = 1  # engines running at once (1 on a GPU host: one engine holds the GPU)

    def select(self, ids: list[str] | None) -> "Matrix":
        """Only the named configurations (plus the baseline, which the comparison needs)."""
        if not ids:
            return self
        known = {c.id for c in self.configs}
        unknown = [i for i in ids if i not in known]
        if unknown:
            raise UsageError(f"matrix {self.name!r} has no configuration(s) {', '.join(unknown)}; "
                             f"valid: {', '.join(sorted(known))}")
        keep = set(ids) | ({self.baseline} if self.baseline else set())
        return replace(self, configs=tuple(c for c in self.configs if c.id in keep))

    def check_fits(self, prompt_tokens: int, extra_engine: dict | None = None) -> None:
        """The engines' context must hold the prompt and every configuration's new tokens. Without
        `max_model_len` vLLM sizes the KV cache for the checkpoint's whole context (262,144 tokens for
        Qwen3.5), and a large model on a 24 GB card fails before any configuration runs."""
        limit = {**self.engine, **(extra_engine or {})}.get("max_model_len")
        if limit is None:
            raise UsageError(f"matrix {self.name!r} sets no engine max_model_len: vLLM would reserve KV cache for "
                             "the checkpoint's whole context; add `max_model_len` under `engine:` in " + self.path)
        need = prompt_tokens + max(c.max_tokens for c in self.configs)
        if need > limit:
            raise UsageError(f"matrix {self.name!r}: a {prompt_tokens}-token prompt and up to "
                             f"{need - prompt_tokens} new tokens need max_model_len >= {need}, it is {limit}")

    def with_parallel(self, parallel: int | None) -> "Matrix":
        """`parallel` engines at a time (None: the matrix's own)."""
        if parallel is None:
            return self
        if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
            raise UsageError(f"parallel must be an integer >= 1, got {parallel!r}")
        return replace(self, parallel=parallel)

    def with_environment(self, variables: dict | None) -> "Matrix":
        """More environment variables for every engine process (an environment's own needs)."""
        return replace(self, environment={**self.environment, **{str(k): str(v) for k, v in (variables or {}).items()}})

    def with_sampling(self, max_tokens: int | None = None, ignore_eos: bool | None = None) -> "Matrix":
        """Every configuration with `max_tokens` new tokens and `ignore_eos` (None: each keeps its own)."""
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
            raise UsageError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if ignore_eos is not None and not isinstance(ignore_eos, bool):
            raise UsageError(f"ignore_eos must be true or false, got {ignore_eos!r}")
        changes = {k: v for k, v in (("max_tokens", max_tokens), ("ignore_eos", ignore_eos)) if v is not None}
        return replace(self, configs=tuple(replace(c, **changes) for c in self.configs))

    def with_repeats(self, repeats: int | None) -> "Matrix":
        """Every configuration with `repeats` repeats (None: each keeps its own)."""
        if repeats is None:
            return self
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise UsageError(f"repeats must be an integer >= 1, got {repeats!r}")
        return replace(self, configs=tuple(replace(c, repeats=repeats) for c in self.configs))


def matrix_path(name_or_path: str | Path | None) -> Path:
    """A matrix by name (a file in spectie/engines/matrices/) or by path; default: the incident's."""
    if name_or_path is None:
        return MATRICES / "incident.yaml"
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml") and not path.exists():
        named = MATRICES / f"{name_or_path}.yaml"
        if not named.is_file():
            valid = ", ".join(sorted(p.stem for p in MATRICES.glob("*.yaml")))
            raise UsageError(f"unknown matrix {str(name_or_path)!r}; give a YAML file or one of: {valid}")
        return named
    return path


def default_matrix_name(environment: str) -> str:
    """The matrix a run takes unless told otherwise: the CPU matrix in the `cpu` environment, else the incident's."""
    return "cpu" if environment == "cpu" else "incident"


def read_matrix(name_or_path: str | Path | None = None) -> Matrix:
    """A matrix file, validated: its configurations (expanded per K), baseline, engine arguments."""
    path = matrix_path(name_or_path)
    configs = load_matrix(path)
    data = read_yaml(path, "matrix file")
    unknown = sorted(set(data) - {"defaults", "engine", "environment", "baseline", "parallel", "configurations"})
    if unknown:
        raise UsageError(f"{path.name}: unknown top-level key(s) {', '.join(unknown)}; valid: defaults, "
                         "engine, environment, baseline, parallel, configurations")
    parallel = data.get("parallel", 1)
    if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
        raise UsageError(f"{path.name}: parallel must be an integer >= 1, got {parallel!r}")
    engine, environment = data.get("engine") or {}, data.get("environment") or {}
    for key, value in (("engine", engine), ("environment", environment)):
        if not isinstance(value, dict):
            raise UsageError(f"{path.name}: '{key}' must be a mapping")
    reserved = sorted(set(engine) & {"model", "enforce_eager", "enable_prefix_caching", "speculative_config"})
    if reserved:
        raise UsageError(f"{path.name}: engine argument(s) {', '.join(reserved)} are set per configuration")
    baseline = data.get("baseline")
    if baseline is not None and baseline not in {c.id for c in configs}:
        raise UsageError(f"{path.name}: baseline {baseline!r} is not a configuration id")
    ordered = sorted(configs, key=lambda c: c.id != baseline)  # the baseline runs first
    return Matrix(path.stem, str(path), tuple(ordered), baseline, dict(engine),
                  {str(k): str(v) for k, v in environment.items()}, parallel)


def load_matrix(path: str | Path | None = None) -> list[EngineConfig]:
    """The configurations of a matrix file (default: the incident's), validated and expanded per K."""
    path = Path(path) if path else MATRICES / "incident.yaml"
    data = read_yaml(path, "matrix file")
    if not isinstance(data, dict) or not isinstance(data.get("configurations"), list):
        raise UsageError(f"matrix file {str(path)!r} needs a 'configurations' list")
    defaults = data.get("defaults") or {}
    configs, seen = [], set()
    for index, raw in enumerate(data["configurations"]):
        entry = {**defaults, **raw}
        where = f"{path.name}: configuration {raw.get('id', index)!r}"
        if "id" not in raw:
            raise UsageError(f"{where}: needs an id")
        _check(entry, where)
        ks = entry.get("k") if isinstance(entry.get("k"), list) else [entry.get("k")]
        for k in ks:
            config_id = entry["id"] if len(ks) == 1 else f"{entry['id']}-k{k}"
            if config_id in seen:
                raise UsageError(f"{where}: id {config_id!r} is used twice")
            seen.add(config_id)
            configs.append(EngineConfig(**{**entry, "id": config_id, "k": k}))
    return configs
