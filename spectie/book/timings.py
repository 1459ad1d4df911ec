"""The project's feedback times as a record of the machine that measured them.

`scripts/time_pipeline.sh` times, in a fresh clone, `make setup && make test`, `make build` from clean, `make test`
on the built tree and a rebuild after a one-line edit, and keeps its figures in the clone's `_timings/` as it goes
(`steps.jsonl`; after the clean build, each chapter's papermill time and a copy of the records it measured). This
module turns that folder into a record (kind `pipeline-timings`, chapter `execution`) of this machine, and into the
execution appendix's table, sentence and figure:

    python -m spectie.book.timings record /tmp/spectie-timings [--new-host [--hardware-known]]
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from spectie.records.errors import UsageError
from spectie.records.record_types import Record

KIND = "pipeline-timings"
CHAPTER = "execution"
COMMAND = "NEW_HOST=1 scripts/time_pipeline.sh"  # a machine of hardware new to the records
TWIN_COMMAND = "NEW_HOST=twin scripts/time_pipeline.sh"  # a new machine of hardware the records know
# step -> (what it times, target in seconds; a clean build on a host new to the records measures it: its own target)
STEPS = {
    "fresh": ("fresh clone: make setup && make test", 600),
    "clean-build": ("make build from clean", 480),
    "built-test": ("make test, book built and current", 240),
    "env-edit-build": ("make build after editing one environment's text", 60),
}
NEW_HOST_BUILD_TARGET = 600


def _epoch(timestamp: str) -> float:
    return dt.datetime.fromisoformat(timestamp).timestamp()


def read_run(directory: str | Path) -> dict:
    """What a time_pipeline run left in `directory` (the clone): its steps, the clean build's chapters and
    measurements, and the commit it timed. A folder without `_timings/steps.jsonl` is a UsageError."""
    root = Path(directory)
    steps_file = root / "_timings" / "steps.jsonl"
    if not steps_file.is_file():
        raise UsageError(f"{steps_file} does not exist: run scripts/time_pipeline.sh {directory} first")
    steps = [json.loads(line) for line in steps_file.read_text().splitlines() if line.strip()]
    chapters_file = root / "_timings" / "clean-build-chapters.json"
    chapters = json.loads(chapters_file.read_text()) if chapters_file.is_file() else []
    build = next((s for s in steps if s["step"] == "clean-build"), None)
    measurements = []
    if build is not None:
        for path in sorted((root / "_timings" / "clean-build-measured").glob("*/*/*.json")):
            stored = json.loads(path.read_text())
            started, finished = stored.get("started_at"), stored.get("finished_at")
            if not (started and finished) or _epoch(started) < build["started"]:
                continue  # made before the clean build (committed, or by the fresh clone's tests)
            measurements.append({"record": stored["id"], "kind": stored["kind"], "chapter": stored["chapter"],
                                 "seconds": round(_epoch(finished) - _epoch(started), 1)})
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    return {"steps": steps, "chapters": chapters,
            "measurements": sorted(measurements, key=lambda m: -m["seconds"]), "commit": commit or None}


def targets(measures_everything: bool) -> dict[str, int]:
    return {step: (NEW_HOST_BUILD_TARGET if measures_everything and step == "clean-build" else target)
            for step, (_, target) in STEPS.items()}


def make_record(directory: str | Path, new_host: bool, results_dir=None, hardware_known: bool = False) -> Record:
    """This machine's record of a time_pipeline run in `directory` (one per host and kind of run: a later run
    replaces it). `new_host`: with a machine id new to the records; `hardware_known`: on hardware the records know,
    whose measurements its builds reused (else it measured everything)."""
    from spectie.records.fingerprint import host_id, now
    from spectie.records.store import measured_path, measured_record, read_record, write_record

    if hardware_known and not new_host:
        raise UsageError("--hardware-known describes a run with --new-host")
    run = read_run(directory)
    goal = targets(new_host and not hardware_known)
    steps = [{"step": s["step"], "what": STEPS[s["step"]][0], "seconds": s["seconds"], "ok": s["ok"],
              "target_seconds": goal[s["step"]]} for s in run["steps"] if s["step"] in STEPS]
    first = min(s["started"] for s in run["steps"])
    variant = "-twin-host" if hardware_known else "-new-host" if new_host else ""
    record = measured_record(
        record_id=f"{KIND}-cpu-{host_id()}{variant}", kind=KIND, chapter=CHAPTER,
        title="The project's feedback times in a fresh clone" + (", as a machine new to the records" if new_host else ""),
        environment="cpu",
        parameters={"command": TWIN_COMMAND if hardware_known else COMMAND if new_host else "scripts/time_pipeline.sh",
                    "new_host": new_host, "hardware_known": hardware_known, "source_commit": run["commit"]},
        results={"cores": os.cpu_count(), "steps": steps, "clean_build_chapters": run["chapters"],
                 "clean_build_measurements": run["measurements"]},
        started_at=dt.datetime.fromtimestamp(first, dt.timezone.utc).isoformat(timespec="seconds"),
        content_hash=hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest(), finished_at=now())
    return read_record(write_record(record, measured_path(record, results_dir)))


# The execution appendix. ----------------------------------------------------------------------------------------


def timing_records() -> list[Record]:
    from spectie.records.store import load_records

    return load_records(chapter=CHAPTER, kind=KIND)


def host_label(record: Record) -> str:
    return f"{record.fingerprint.cpu} ({record.results.cores} cores, host {record.fingerprint.host_id})"


def run_label(record: Record) -> str:
    """How the run saw the machine: known to the records, new to them, or new on hardware they know."""
    if not record.parameters.new_host:
        return ""
    return ", new to the records, its hardware known" if record.parameters.hardware_known else ", new to the records"


def steps_table(records: list[Record]) -> list[dict]:
    """One row per step of every timing record: what, the machine, seconds against the target."""
    return [{"what": step["what"], "machine": host_label(r) + run_label(r),
             "seconds": step["seconds"], "target (s)": step["target_seconds"],
             "target met": ("yes" if step["seconds"] <= step["target_seconds"] else "no") if step["ok"] else "failed",
             "commit": (r.parameters.source_commit or "unknown")[:7], "measured": r.finished_at[:10]}
            for r in records for step in r.results.steps]


def first_build_sentence(records: list[Record]) -> str:
    """What a host new to the records spent its first clean build on, per such record; or how to measure it."""
    new = [r for r in records if r.parameters.new_host]
    sentences = []
    for record in new:
        build = next((s for s in record.results.steps if s["step"] == "clean-build"), None)
        if build is None:
            sentences.append(f"On {host_label(record)} the run ended before its clean build.")
            continue
        verdict = "within" if build["ok"] and build["seconds"] <= build["target_seconds"] else "over"
        chapters = sorted(record.results.clean_build_chapters, key=lambda c: -c["seconds"])
        rest = build["seconds"] - sum(c["seconds"] for c in chapters)
        parts = ", ".join(f"{c['chapter']} {c['seconds']:.0f} s" for c in chapters if c["seconds"] >= 1)
        longest = ", ".join(f"{m['kind']} ({m['record']}) {m['seconds']:.0f} s"
                            for m in record.results.clean_build_measurements[:4])
        how = ("a machine id of its own, on hardware the records know: its builds reused the measurements of a host "
               "of identical hardware" if record.parameters.hardware_known else
               "a machine id of its own, no other host's records reused: its builds measured everything")
        sentences.append(
            f"On {host_label(record)}, as a machine new to the records ({how}), at commit "
            f"{(record.parameters.source_commit or 'unknown')[:7]}: make build from clean took {build['seconds']} s, "
            f"{verdict} its target of {build['target_seconds']} s"
            + (" (it failed)" if not build["ok"] else "") + ". "
            + (f"Its chapters: {parts}; the rest (staleness checks, the HTML) {max(rest, 0):.0f} s. " if parts else "")
            + (f"Its longest measurements: {longest} (engines that ran at once overlap)." if longest else
               "It measured nothing."))
    sentences += [f"A new machine's first build on {what} is not timed yet: {command} (as root) times it."
                  for what, command, known in (("hardware new to the records", COMMAND, False),
                                               ("hardware the records know", TWIN_COMMAND, True))
                  if not any(bool(r.parameters.hardware_known) == known for r in new)]
    return " ".join(sentences)


def first_build_figure(records: list[Record]):
    """Each new-host clean build as a bar per chapter (seconds), the rest of the build last; None without one."""
    import matplotlib.pyplot as plt

    new = [r for r in records if r.parameters.new_host and r.results.clean_build_chapters]
    if not new:
        return None
    figure, axes = plt.subplots(len(new), 1, figsize=(7, 0.5 + 0.35 * 9 * len(new)), squeeze=False)
    for axis, record in zip(axes[:, 0], new):
        build = next(s for s in record.results.steps if s["step"] == "clean-build")
        chapters = sorted(record.results.clean_build_chapters, key=lambda c: c["seconds"])
        names = [c["chapter"] for c in chapters] + ["rest (checks, HTML)"]
        seconds = [c["seconds"] for c in chapters] + [max(build["seconds"] - sum(c["seconds"] for c in chapters), 0)]
        axis.barh(names, seconds, color="#4c72b0")
        axis.set_xlabel("seconds")
        axis.set_title(f"First clean build, {host_label(record)}{run_label(record)}: {build['seconds']} s "
                       f"(target {build['target_seconds']} s)", fontsize=9)
    figure.tight_layout()
    return figure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spectie.book.timings", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    record = commands.add_parser("record", help="a time_pipeline run's figures as a record of this machine")
    record.add_argument("directory", help="the clone time_pipeline.sh ran in")
    record.add_argument("--new-host", action="store_true", help="it ran with a machine id new to the records")
    record.add_argument("--hardware-known", action="store_true",
                        help="with --new-host: on hardware the records know, whose measurements its builds reused")
    args = parser.parse_args(argv)
    try:
        made = make_record(args.directory, args.new_host, hardware_known=args.hardware_known)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {made.id}: " + "; ".join(f"{s['what']} {s['seconds']} s" for s in made.results.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
