"""Stored measurement keys recomputed from their records.

A measured record holds the key of the measurement it made (`fingerprint.measurement_key`): a digest of its kind,
weights, arguments, library versions, the code that computes it and the device. Here each kind's arguments are
rebuilt from the record's own parameters, and the key is computed as its host computed it (`fingerprint.keyed_as`:
the library versions of its fingerprint, the hardware its host's records name) with today's code.

    python -m spectie.rekey check [--save FILE]   which stored keys today's code gives again
    python -m spectie.rekey write --from FILE     store today's keys in the records FILE lists

A record whose key today's code does not give again is measured again where a build would reuse it. `write` is for
code that moved without changing what it computes (a file renamed, an import rewritten): `check --save` before the
move lists the records whose keys held, and `write --from` after it stores their new keys, leaving every result as
it was. Kinds whose arguments cannot be rebuilt (the keys computed by a process with other library versions than
its record names, e.g. GPU hosts' engine runs) are said, not guessed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from spectie.records.errors import UsageError

MARGINS_KINDS = ("designed-decisions", "flip-curve", "logit-comparison", "margin-scan")


def _engine_outcome(record: dict, path: Path):
    """The engine child's request (`engines.runner.request_for`), as the record keeps it."""
    from spectie.engines import runner

    p = record["parameters"]
    sampling = {"temperature": p["temperature"], "max_tokens": p["max_tokens"], "logprobs": 2}
    if p.get("ignore_eos"):
        sampling["ignore_eos"] = True
    prompts = p["prompt_token_ids"]
    prompts = [prompts] if prompts and isinstance(prompts[0], int) else prompts
    request = {"llm_kwargs": dict(p["llm_kwargs"]), "sampling": sampling, "prompts": prompts, "sequential": True,
               "repeats": p["repeats"], "tail_tokens": 8, "environment": p.get("environment_variables") or {}}
    return lambda: runner.request_key(request, record["fingerprint"].get("vllm"))


def _survey(record: dict, path: Path):
    from spectie.engines import survey
    from spectie.records.fingerprint import measurement_key
    from spectie.lab.model import resolve_model

    p = record["parameters"]
    arguments = {"prompts": p["prompts"], "configurations": p["configurations"], "model_label": p["model"],
                 "max_tokens": p["configurations"][0]["max_tokens"], "environment": record["environments"][0]}
    return lambda: measurement_key("tiestop-survey", str(resolve_model(p["model"])), arguments, survey.SURVEY_SOURCES)


def _injection(record: dict, path: Path):
    from spectie.engines import survey
    from spectie.records.fingerprint import measurement_key
    from spectie.lab.model import resolve_model

    p = record["parameters"]
    arguments = {"prompts": p["prompts"], "new_tokens": p["new_tokens"], "dtype": p["dtype"], "model_label": p["model"]}
    return lambda: measurement_key("tiestop-injection", str(resolve_model(p["model"])), arguments,
                                   survey.INJECTION_SOURCES)


def _guard_survey(record: dict, path: Path):
    from spectie.engines import guard_measure
    from spectie.records.fingerprint import measurement_key
    from spectie.lab.model import resolve_model

    p = record["parameters"]
    arguments = {"prompts": p["prompts"], "max_tokens": p["max_tokens"], "speculative": guard_measure.SPECULATIVE,
                 "model_label": p["model"], "environment": record["environments"][0]}
    return lambda: measurement_key(guard_measure.KIND, str(resolve_model(p["model"])), arguments,
                                   guard_measure.GUARD_SOURCES)


def _margins(record: dict, path: Path):
    """The chapter's four records share one key: the flip curve's and the designed decisions' parameters hold it."""
    from spectie.lab import margins
    from spectie.records.fingerprint import measurement_key
    from spectie.lab.model import resolve_model
    from spectie.lab.prompts import prompt_set

    host, environment = record["fingerprint"]["host_id"], record["environments"][0]
    sibling = lambda name: json.loads((path.parent / f"margins-{environment}-{name}-{host}.json").read_text())  # noqa: E731
    flips, decisions = sibling("flips")["parameters"], sibling("decisions")["parameters"]
    prompt = flips["prompt"]
    common = {k: flips[k] for k in ("prompt", "max_new_tokens", "watch_tokens", "serving_dtype", "compare_dtypes")}
    decision = prompt_set(decisions["decision_prompts"], prompt["tokens"], template=prompt["template"])
    sweep = prompt_set(flips["sweep_prompts"], flips["sweep_prompt_tokens"], first_seed=1000, template=prompt["template"])
    arguments = {"device": flips["device"], **common, "sweep_prompts": flips["sweep_prompts"],
                 "sweep_prompt_tokens": flips["sweep_prompt_tokens"], "sweep_new_tokens": flips["sweep_new_tokens"],
                 "decision_prompts": len(decision), "decision_specs": [asdict(s) for s in decision],
                 "sweep_specs": [asdict(s) for s in sweep]}
    return lambda: measurement_key("margins", str(resolve_model(record["parameters"]["model"])), arguments,
                                   margins.SOURCES)


def _reduction(record: dict, path: Path):
    from spectie.lab import reduction_order
    from spectie.records.fingerprint import measurement_key

    p = record["parameters"]
    arguments = {k: p[k] for k in ("model", "device", "dtypes", "shapes", "kernels", "tf32", "prompt_tokens",
                                   "prompt_seed", "new_tokens", "reference_dtype", "weights_seed", "logit_std")}
    return lambda: measurement_key("reduction-sweep", p["model"], arguments, reduction_order.SOURCES)


REBUILDS = {"engine-outcome": _engine_outcome, "tiestop-survey": _survey, "tiestop-injection": _injection,
            "guard-survey": _guard_survey, "reduction-sweep": _reduction, **dict.fromkeys(MARGINS_KINDS, _margins)}


def recomputed(path: Path, hardware: dict[str, dict]) -> tuple[str, str | None]:
    """(status, today's key) of the record at `path`: "same" or "differs" where its key is recomputed, else why
    not ("no key", "kind not rebuilt", "host's hardware unknown", "computed by the engine environment's caller",
    "inputs missing: ..."). `hardware`: each host's, as its records name it (`fingerprint.recorded_hardware`)."""
    return _recompute(json.loads(path.read_text()), path, hardware)


def _recompute(record: dict, path: Path, hardware: dict[str, dict]) -> tuple[str, str | None]:
    from spectie.records.fingerprint import keyed_as

    parameters, fingerprint = record.get("parameters") or {}, record.get("fingerprint") or {}
    if "measurement_key" not in parameters:
        return "no key", None
    if (rebuild := REBUILDS.get(record.get("kind"))) is None:
        return "kind not rebuilt", None
    if (on := hardware.get(fingerprint.get("host_id"))) is None:
        return "host's hardware unknown", None
    if record["kind"] == "engine-outcome" and record.get("environments") != ["cpu"]:
        # The key was computed by the project's interpreter, the engine ran in its environment's: only the
        # engine's library versions are recorded.
        return "computed by the engine environment's caller", None
    try:
        compute = rebuild(record, path)
        with keyed_as(on, fingerprint):
            key = compute()
    except (KeyError, IndexError, TypeError, OSError, UsageError) as exc:
        return f"inputs missing: {type(exc).__name__}: {exc}", None
    return ("same" if key == parameters["measurement_key"] else "differs"), key


def measured_files(root: Path) -> list[Path]:
    """Every measured record file of the project at `root`: the book's and the diagnosed examples'."""
    return sorted([*root.glob("results/measured/*/*/*.json"),
                   *root.glob("examples/requests/diagnosed/*/results/measured/*/*/*.json")])


def hosts_hardware(root: Path) -> dict[str, dict]:
    """Each host's hardware as the project's records name it (the book's and the diagnosed examples')."""
    from spectie.records.fingerprint import recorded_hardware

    return {host: found for results in (root / "results", *root.glob("examples/requests/diagnosed/*/results"))
            for host, found in recorded_hardware(results).items()}


def check(root: Path, save: Path | None = None, log=print) -> int:
    """Say, per status and kind, which stored keys today's code gives again; 1 where one differs."""
    from collections import Counter

    hardware = hosts_hardware(root)
    records = {path: json.loads(path.read_text()) for path in measured_files(root)}
    statuses = {path: _recompute(record, path, hardware)[0] for path, record in records.items()}
    for (status, kind), count in sorted(Counter((s, records[p].get("kind")) for p, s in statuses.items()).items()):
        log(f"{count:4d}  {status}: {kind}")
    differing = [p for p, s in statuses.items() if s == "differs"]
    for path in differing:
        log(f"differs: {path.relative_to(root)}")
    if save is not None:
        same = [str(p.relative_to(root)) for p, s in statuses.items() if s == "same"]
        save.write_text(json.dumps(same, indent=1) + "\n")
        log(f"{len(same)} record(s) whose key held: {save}")
    return 1 if differing else 0


def write(root: Path, listed: Path, log=print) -> int:
    """Store today's key in each record `listed` names (`check --save` before code moved); its results stay."""
    from spectie.records.store import write_record

    hardware = hosts_hardware(root)
    try:
        names = json.loads(listed.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--from {listed}: not a list that `check --save` wrote ({exc})") from None
    changed = 0
    for name in names:
        path = root / name
        status, key = recomputed(path, hardware)
        if key is None:
            raise UsageError(f"{name}: its key is not recomputed here ({status})")
        if status == "differs":
            record = json.loads(path.read_text())
            record["parameters"]["measurement_key"] = key
            write_record(record, path)
            changed += 1
    log(f"stored today's key in {changed} of {len(names)} record(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from spectie.records.paths import project_root

    parser = argparse.ArgumentParser(prog="python -m spectie.rekey", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    checking = commands.add_parser("check", help="which stored keys today's code gives again (exit 1: one differs)")
    checking.add_argument("--save", type=Path, help="write the records whose key held to this file")
    writing = commands.add_parser("write", help="store today's keys in the records a `check --save` listed")
    writing.add_argument("--from", dest="listed", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            return check(project_root(), args.save)
        return write(project_root(), args.listed)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
