"""What a reproduction run will do, checked before any engine starts: the environment, the matrix with the
chapter's choices applied, the prompt seeds, the extra engine arguments, the model, the installed vLLM and the
prompts (the reproduce chapter's first step; spectie.engines.matrix_run.run_matrix is the next).

    plan = make_plan(environment="cpu", matrix="auto", model="organism")   # UsageError on anything wrong
    print(plan.describe())
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spectie.engines import checks
from spectie.engines.matrix import Matrix, default_matrix_name, read_matrix
from spectie.records.errors import UsageError


@dataclass(frozen=True)
class Plan:
    environment: dict  # the environment file's content (spectie.records.environments.get_environment)
    matrix: Matrix  # with the chosen configurations, repeats, engines at a time and sampling
    seeds: list[int]
    extra_engine: dict  # more vllm.LLM arguments for every engine (the environment's, the chapter's, tensor parallel)
    model_path: str
    model_label: str  # a random-weight checkpoint is named by shape and seed, not by its folder
    probe: dict  # the installed vLLM (checks.probe_vllm)
    prompts: dict = field(default_factory=dict)  # seed -> the prompt (spectie.lab.prompts.Prompt)

    @property
    def prompt(self):
        """The first seed's prompt: the one the chapter's tables show."""
        return self.prompts[self.seeds[0]]

    def prompt_ids(self) -> dict[int, list[int]]:
        return {seed: list(p.token_ids) for seed, p in self.prompts.items()}

    def describe(self) -> str:
        probe, matrix, prompt = self.probe, self.matrix, self.prompt
        return (f"vLLM {probe['vllm_version']} on {probe['platform']} (torch {probe['torch']}); model "
                f"{self.model_label}; matrix {matrix.name}: {len(matrix.configs)} configurations, baseline "
                f"{matrix.baseline!r}, {matrix.parallel} engine(s) at a time\n"
                f"prompts: seeds {self.seeds}, {len(prompt.token_ids)} tokens each, ending {prompt.text[-40:]!r}")


def extra_engine_arguments(environment: dict, arguments, tensor_parallel_size) -> dict:
    """The extra vllm.LLM arguments of every engine: the environment's, then the chapter's, then tensor parallelism
    (when above 1); each checked."""
    if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1:
        raise UsageError(f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}")
    if not isinstance(arguments, dict):
        raise UsageError(f"engine_arguments must be a mapping of vllm.LLM arguments, got {arguments!r}")
    return {**(environment.get("engine") or {}), **arguments,
            **({"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {})}


def choose_matrix(environment: dict, matrix: str, configurations: list[str] | None = None, repeats: int | None = None,
                  parallel: int | None = None, max_tokens: int | None = None,
                  ignore_eos: bool | None = None) -> Matrix:
    """The matrix file ("auto": the CPU matrix for the `cpu` environment, else the incident's) with the chapter's
    choices applied, and the environment's own engine variables."""
    name = default_matrix_name(environment["id"]) if matrix == "auto" else matrix
    chosen = read_matrix(name).select(configurations).with_repeats(repeats).with_parallel(parallel)
    return chosen.with_sampling(max_tokens, ignore_eos).with_environment(environment.get("engine_environment"))


GPU_SEEDS = list(range(8))  # the incident's prompt and seven more listings: the GPU runs' early stops were among them


def default_seeds(environment: dict) -> list[int]:
    """The prompt seeds a run takes unless told otherwise: 0 to 7 on a GPU (where the recorded silent stops were on
    seeds other than the incident's own), the incident's prompt alone on the CPU build (the default build's run)."""
    return GPU_SEEDS if checks.gpu_count(environment) else [0]


def make_plan(environment: str = "cpu", matrix: str = "auto", model: str = "organism", *,
              configurations: list[str] | None = None, repeats: int | None = None, max_tokens: int | None = None,
              ignore_eos: bool | None = None, prompt_tokens: int = 1845, prompt_seeds: list[int] | None = None,
              template: str = "raw", tensor_parallel_size: int = 1, engine_arguments: dict | None = None,
              parallel: int | None = None) -> Plan:
    """Everything a run needs, checked in order of cost (parameters, matrix, model, the installed vLLM, then the
    prompts against the engines' context): a UsageError says what is wrong before any engine starts."""
    from spectie.lab import qwen_shapes
    from spectie.engines.checks import check_installed
    from spectie.records.environments import get_environment
    from spectie.lab.model import resolve_model

    env = get_environment(environment)
    chosen = choose_matrix(env, matrix, configurations, repeats, parallel, max_tokens, ignore_eos)
    seeds = checks.check_seeds(default_seeds(env) if prompt_seeds is None else prompt_seeds)
    extra = extra_engine_arguments(env, {} if engine_arguments is None else engine_arguments, tensor_parallel_size)
    checks.check_devices(env, tensor_parallel_size)
    chosen, extra = checks.split_over_cores(env, chosen, extra)
    model_path = resolve_model(model)
    label = qwen_shapes.model_label(model, model_path)
    probe = checks.probe_vllm(environment)
    check_installed(env, probe)  # the vLLM that runs is the one the environment names
    checks.check_matrix(chosen, probe, extra)
    prompts = {seed: checks.build_prompt(model_path, prompt_tokens, seed, template) for seed in seeds}
    chosen.check_fits(max(len(p.token_ids) for p in prompts.values()), extra)
    return Plan(env, chosen, seeds, extra, model_path, label, probe, prompts)
