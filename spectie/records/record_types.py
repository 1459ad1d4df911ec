"""Typed run records: what each kind of record holds, as attributes.

`Record.from_dict` builds one from a stored record (store.py validates it against record.schema.json first).
Each kind has a type for its `parameters` and one for its `results`; a field that the kind's type does not
declare is refused, so the types, the schema and the stored records stay in step (tests/test_records.py reads
every stored record and the schema's declared fields). A field the record leaves out reads as None: reported
records say less than measured ones. Nested rows (table rows, repeats, prompts) stay as the JSON holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from spectie.records.record_fields import Fields, Fingerprint, RecordError, Source, _optional  # noqa: F401 (RecordError: re-exported)


class Verdict(str, Enum):
    """The divergence classifier's verdict on a first divergence (spectie.tools.divergence), in the tool's words;
    `label` is how case files and verdict records store it, `short` how a figure marks it."""
    NEAR_TIE = "numerical near-tie"
    BUG = "suspected correctness bug"
    IDENTICAL = "identical"

    def __str__(self) -> str:
        return self.value

    @property
    def label(self) -> str:
        return {"numerical near-tie": "near-tie", "suspected correctness bug": "bug"}.get(self.value, self.value)

    @property
    def short(self) -> str:
        return {"numerical near-tie": "near-tie", "suspected correctness bug": "suspected bug"}.get(self.value,
                                                                                                   self.value)


@_optional
class NoParameters(Fields):
    """A kind whose records have no parameters."""


@_optional
class EngineConfiguration(Fields):
    """One engine configuration of a matrix, as run (measured) or as the incident states it (reported)."""
    configuration: str | None
    matrix: str | None
    baseline: str | None
    model: str | None
    method: str | None
    num_speculative_tokens: int | list[int] | None
    model_runner: str | None
    enforce_eager: bool | None
    cudagraph_mode: str | None
    enable_prefix_caching: bool | None
    batch_invariant: bool | None
    environment_variables: dict | None
    llm_kwargs: dict | None
    max_tokens: int | None
    temperature: float | None
    ignore_eos: bool | None
    prompt_tokens: int | None
    prompt_seed: int | None
    prompt_seeds: int | None
    prompt_token_ids: list[int] | None
    tensor_parallel_size: int | None
    repeats: int | None
    expect: str | None
    measurement_key: str | None
    request_key: str | None

    @property
    def ranks(self) -> int:
        """The tensor-parallel ranks the engine was split over (records made before the size was stated: one)."""
        return self.tensor_parallel_size or 1


@_optional
class EngineOutcome(Fields):
    """What one engine configuration did (engines/runner.summarize); `repeats` holds one dict per generation."""
    status: str | None
    error: dict | None
    stopped_early: bool | None
    runs_stopped: int | None
    runs_total: int | None
    finish_reason: str | None
    stop_offset_from_prompt_len: int | None
    output_tokens_before_stop: int | None
    stop_position: int | None
    tail_text: str | None
    identical_outputs: bool | None
    distinct_outputs: int | None
    same_position_as: str | None
    expected: str | None
    as_expected: bool | None
    repeats: list[dict] | None
    prompt_tokens: int | None
    backend: str | None
    placement: dict | None
    model_runner_used: str | None
    vllm_version: str | None
    engine_start_seconds: float | None
    seconds: float | None


@_optional
class IncidentParameters(Fields):
    model_family: str
    architecture: str
    linear_to_full_attention_ratio: str
    methods: list[str]
    num_speculative_tokens_tested: list[int]
    sampling: str
    temperature: float
    max_tokens: int
    prompt_tokens: int
    enforce_eager: bool
    enable_prefix_caching: bool


@_optional
class IncidentClaims(Fields):
    claimed_trigger: str
    claimed_min_k: int
    competing_token: str
    token_ids: dict


@_optional
class RelatedReport(Fields):
    summary: str
    issue: int | None
    pull_requests: list | None
    status: str | None
    environment_variable: str | None
    exact_match_percent_low: float | None
    exact_match_percent_high: float | None


@_optional
class MarginParameters(Fields):
    """The margins chapter's measurements (and the incident's logit comparison, which states fewer)."""
    model: str
    device: str
    serving_dtype: str
    compare_dtypes: list[str]
    prompt: dict
    max_new_tokens: int
    watch_tokens: list[str]
    decision_prompts: int | None
    sweep_prompts: int | None
    sweep_prompt_tokens: int | None
    sweep_new_tokens: int | None
    reference: str | None
    prompt_tokens: int | None
    measurement_key: str | None


@_optional
class LogitComparison(Fields):
    position: int
    tokens: dict
    rows: list[dict]
    finish_reason: str | None
    output_tokens: int | None
    tail_text: str | None


@_optional
class MarginScan(Fields):
    rows: list[dict]
    output_ids: list[int]
    finish_reason: str


@_optional
class DesignedDecisions(Fields):
    reference: str
    band: float
    count: int
    inside: list
    flipped: list
    other: str
    median_shift: float
    rows: list[dict]


@_optional
class FlipCurve(Fields):
    reference: str
    pairs: list[dict]
    bins: list[dict]
    eos_decision_margins: list[float]
    eos_flips: list
    other: str


@_optional
class SweepParameters(Fields):
    """The reduction-order chapter's sweep and the benchmark's: the model, its shapes and the kernels run."""
    model: str
    device: str
    dtypes: list[str]
    kernels: str | list[str]
    shapes: list
    tf32: bool | list[bool]
    prompt_tokens: int
    new_tokens: int
    prompt_seed: int | None
    weights_seed: int | None
    logit_std: float | None
    reference_dtype: str | None
    repeats: int | None
    measurement_key: str | None


@_optional
class ReductionSweep(Fields):
    reference: dict
    rows: list[dict]
    positions: int
    prompt: dict
    output_tokens: int
    finish_reason: str
    model_parameters: int
    weights: dict
    reference_logits: dict | None


@_optional
class Benchmark(Fields):
    rows: list[dict]
    parameters: dict
    bf16_matmul_flops_per_s: float | None


@_optional
class LedgerParameters(Fields):
    source: str
    source_sha256: str
    releases: list[str]
    not_requested: list
    command: str
    pip_download: str


@_optional
class FixLedger(Fields):
    releases: list[dict]
    fixes: list[dict]


@_optional
class SurveyParameters(Fields):
    """The near-tie survey (tiestop-survey), the planted near-ties (tiestop-injection) and the guard's survey."""
    model: str
    prompts: int | list
    prompt_lengths: list[int]
    matrix: str | None
    baseline: str | None
    configurations: list[str] | None
    llm_kwargs: dict | None
    dtype: str | None
    eos_ids: list[int] | None
    new_tokens: int | None
    max_tokens: int | None
    server: str | None
    servers: int | None  # guard survey: identical servers the prompts were shared out over (one per CPU core)
    speculative_config: dict | None
    measurement_key: str | None


@_optional
class SurveyResults(Fields):
    prompts: list[dict]
    configurations: dict | None
    backend: str | None
    vllm_version: str | None
    threshold: float | None
    threshold_origin: str | None
    max_resumes: int | None


@_optional
class VerdictParameters(Fields):
    model: str
    threshold: float
    threshold_origin: str
    engine_environment: str
    engine_device: str
    engine_vllm: str | None


@_optional
class VerdictRows(Fields):
    rows: list[dict]


@_optional
class ProbeParameters(Fields):
    """vllm serve on the shortest prompts (spectie.engines.serve_probe)."""
    model: str
    steps: list[dict]
    request: dict
    command: str
    measurement_key: str


@_optional
class ProbeResults(Fields):
    vllm_version: str
    backend: str
    servers: dict  # server name -> {speculative_config, requests, process_running_after, log_error}


@_optional
class LoadParameters(Fields):
    """The guard under load (spectie.engines.guard_load): one server, its prefix caching, the levels and prompts sent."""
    model: str
    server: str  # plain, mtp-k1, mtp-k8
    speculative_config: dict | None
    prefix_caching: bool
    levels: list[int]  # requests in flight
    prompts: list  # [label, prompt tokens, new tokens]
    copies_seeds: list[int]
    routes: list[str]  # straight, guarded
    batch_seconds: int
    measurement_key: str


@_optional
class LoadResults(Fields):
    vllm_version: str
    backend: str
    server_command: str
    error: str | None  # the server or the proxy did not start: why (no rows then)
    rows: list[dict]  # one per request: level, workload, route, prompt, finish_reason, digest, near_tie_stop, ...
    batches: list[dict]  # one per batch: level, workload, route, requests, wall_seconds, completion_tokens, errors
    threshold: float | None
    threshold_origin: str | None
    max_resumes: int | None


@_optional
class TimingParameters(Fields):
    """A run of scripts/time_pipeline.sh (spectie.book.timings)."""
    command: str
    new_host: bool  # with a machine id new to the records
    hardware_known: bool | None  # new_host on hardware the records know: its builds reused a host's of identical
    # hardware (NEW_HOST=twin); False or None: no other host's records reused, its builds measured everything
    source_commit: str | None  # the commit the clone was made at


@_optional
class TimingResults(Fields):
    cores: int
    steps: list[dict]  # {step, what, seconds, ok, target_seconds}
    clean_build_chapters: list[dict]  # {chapter, seconds}: papermill's time per chapter
    clean_build_measurements: list[dict]  # {record, kind, chapter, seconds}: the records it measured, longest first


KINDS: dict[str, tuple[type[Fields], type[Fields]]] = {
    "incident-configuration": (IncidentParameters, IncidentClaims),
    "related-report": (NoParameters, RelatedReport),
    "engine-outcome": (EngineConfiguration, EngineOutcome),
    "logit-comparison": (MarginParameters, LogitComparison),
    "margin-scan": (MarginParameters, MarginScan),
    "designed-decisions": (MarginParameters, DesignedDecisions),
    "flip-curve": (MarginParameters, FlipCurve),
    "reduction-sweep": (SweepParameters, ReductionSweep),
    "benchmark": (SweepParameters, Benchmark),
    "fix-ledger": (LedgerParameters, FixLedger),
    "tiestop-survey": (SurveyParameters, SurveyResults),
    "tiestop-injection": (SurveyParameters, SurveyResults),
    "guard-survey": (SurveyParameters, SurveyResults),
    "divergence-verdicts": (VerdictParameters, VerdictRows),
    "server-probe": (ProbeParameters, ProbeResults),
    "pipeline-timings": (TimingParameters, TimingResults),
    "guard-load": (LoadParameters, LoadResults),
    "classifier-cases": (VerdictParameters, VerdictRows),
}


@dataclass(frozen=True, kw_only=True, eq=False)
class Record:
    """One run record. `stored` is the JSON object it was read from (what is written back and hashed)."""
    schema_version: int
    id: str
    provenance: str
    kind: str
    chapter: str
    title: str
    environments: tuple[str, ...]
    parameters: Any
    results: Any
    notes: str | None = None
    source: Source | None = None
    fingerprint: Fingerprint | None = None
    started_at: str | None = None
    finished_at: str | None = None
    package_version: str | None = None
    content_hash: str | None = None
    stored: dict = field(repr=False)

    @classmethod
    def from_dict(cls, data: dict, where: str = "<record>") -> Record:
        parameters, results = KINDS[data["kind"]]
        typed = {**data, "environments": tuple(data["environments"]),
                 "parameters": parameters.from_dict(data["parameters"], f"{where}: parameters"),
                 "results": results.from_dict(data["results"], f"{where}: results")}
        if "fingerprint" in data:
            typed["fingerprint"] = Fingerprint.from_dict(data["fingerprint"], f"{where}: fingerprint")
        if "source" in data:
            typed["source"] = Source.from_dict(data["source"], f"{where}: source")
        return cls(**typed, stored=data)

    @property
    def environment(self) -> str | None:
        """The environment a measured record was made in (reported records may name none)."""
        return self.environments[0] if self.environments else None

    @property
    def measured(self) -> bool:
        return self.provenance == "measured"

    @property
    def is_baseline(self) -> bool:
        """An engine run of its matrix's baseline configuration (plain greedy): what the other runs are held against."""
        return self.parameters.configuration == self.parameters.baseline

    @property
    def device(self) -> str:
        """The GPU a measured record ran on, or CPU."""
        return (self.fingerprint and self.fingerprint.gpu) or "CPU"
