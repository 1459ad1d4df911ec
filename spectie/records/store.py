"""Run records: one JSON schema for every result the book shows.

A record is validated when it is written and when it is read. Writes are atomic (a temporary file in
the same folder, then a rename), so a run that fails or is killed never leaves a half-written record
and never replaces a good one with a broken one.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import tempfile
from functools import lru_cache
from pathlib import Path

import jsonschema

from spectie.records.paths import project_root
from spectie.records.record_types import Record, RecordError

__all__ = ["Record", "RecordError"]  # with the functions below

SCHEMA_PATH = Path(__file__).with_name("record.schema.json")
RECORD_SUFFIX = ".json"


@lru_cache(maxsize=1)
def _validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _field_path(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(record)"


def validate_record(record: object, where: str = "<record>") -> dict:
    """Raise RecordError (file and field) unless `record` satisfies the schema; return it."""
    errors = sorted(_validator().iter_errors(record), key=lambda e: (len(e.absolute_path), e.path))
    if errors:
        # The deepest error is usually the most specific one.
        error = max(errors, key=lambda e: len(e.absolute_path))
        raise RecordError(where, _field_path(error), error.message)
    for field in ("started_at", "finished_at"):
        if field in record:
            try:
                dt.datetime.fromisoformat(record[field])
            except ValueError:
                raise RecordError(where, field, f"not an ISO 8601 date-time: {record[field]!r}") from None
    if "started_at" in record and "finished_at" in record:
        if dt.datetime.fromisoformat(record["finished_at"]) < dt.datetime.fromisoformat(record["started_at"]):
            raise RecordError(where, "finished_at", "is earlier than started_at")
    return record


def measured_record(*, record_id: str, kind: str, chapter: str, title: str, environment: str,
                    parameters: dict, results: dict, started_at: str, content_hash: str,
                    dtype: str | None = None, notes: str | None = None,
                    fingerprint: dict | None = None, finished_at: str | None = None) -> dict:
    """A complete measured record: every measured record is built here (validate and write it with
    `write_record`). `fingerprint` and `finished_at` default to this host and now; a run made elsewhere
    (a dump from a GPU host) passes the ones it recorded there."""
    from spectie import __version__
    from spectie.records.fingerprint import environment_fingerprint, now

    record = {
        "schema_version": 1,
        "id": record_id,
        "provenance": "measured",
        "kind": kind,
        "chapter": chapter,
        "title": title,
        "environments": [environment],
        "parameters": parameters,
        "results": results,
        "fingerprint": fingerprint or environment_fingerprint(dtype, parameters.get("model")),
        "started_at": started_at,
        "finished_at": finished_at or now(),
        "package_version": __version__,
        "content_hash": content_hash,
    }
    if notes:
        record["notes"] = notes
    return record


def write_record(record: dict, path: str | os.PathLike) -> Path:
    """Validate `record` and write it to `path` atomically; an earlier record there survives any failure."""
    validate_record(record, where=str(path))
    return write_text_atomic(path, json.dumps(record, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` whole or not at all: what was there before survives any failure or kill."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp-write")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as tmp:
            tmp.write(text)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path


def measured_path(record: dict, results_dir: str | os.PathLike | None = None) -> Path:
    """Where a measured record lives: results/measured/<environment>-<host id>/<chapter>/<id>.json."""
    results_dir = Path(results_dir) if results_dir else project_root() / "results"
    host = f"{record['environments'][0]}-{record['fingerprint']['host_id']}"
    return results_dir / "measured" / host / record["chapter"] / f"{record['id']}{RECORD_SUFFIX}"


def read_record(path: str | os.PathLike) -> Record:
    """Read and validate one record; a broken file raises RecordError naming it and the field."""
    return Record.from_dict(read_stored(path), where=str(path))


def read_stored(path: str | os.PathLike) -> dict:
    """One record as stored (a JSON object), validated against the schema: what writers copy and amend."""
    path = Path(path)
    if not path.is_file():
        raise RecordError(str(path), "(file)", "no such file")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise RecordError(str(path), "(file)", f"not valid JSON: {exc}") from None
    return validate_record(record, where=str(path))


def read_if_valid(path: str | os.PathLike) -> Record | None:
    """The record at `path`, or None where there is none or it is not a valid record (what is made again then)."""
    path = Path(path)
    try:
        return read_record(path) if path.is_file() else None
    except RecordError:
        return None


def recorded_measurement(path: str | os.PathLike, key: str) -> Record | None:
    """The finished record holding the measurement `key` names (`fingerprint.measurement_key`): this host's at
    `path`, else the same measurement by another host of the environment (`twin_paths`). The key holds the device
    (CPU model and ISA flags, GPU models), so another host's record matches only where its hardware is this one's:
    a new machine of identical hardware measures nothing again, and the record it reuses names the host that made
    it. None where no record holds the key (none, unreadable, another measurement, interrupted, or did not start)."""
    for candidate in (Path(path), *twin_paths(path)):
        record = read_if_valid(candidate)
        if record is not None and record.parameters.measurement_key == key \
                and getattr(record.results, "status", None) != "interrupted" and not did_not_start(record):
            return record
    return None


def did_not_start(record: Record) -> bool:
    """A run that failed before its first answer (an error and no row: a `vllm serve` that never came up) measured
    nothing about the engine: its failure is the installation's, so it is made again, not reused, once that is
    mended. A run that answered and then failed, or an engine that crashed on a request, is a result and stays."""
    results = record.results
    return bool(getattr(results, "error", None)) and getattr(results, "rows", None) == []


HOST_ID_PATTERN = re.compile(r"[0-9a-f]{12}")
OWN_RECORDS_ONLY = "SPECTIE_OWN_RECORDS_ONLY"  # "1": reuse this host's records alone, measure as new hardware would


def _own_only() -> bool:
    return os.environ.get(OWN_RECORDS_ONLY) == "1"


def twin_paths(path: str | os.PathLike) -> list[Path]:
    """The record at `path` (results/measured/<environment>-<host id>/<chapter>/<id>.json) as other hosts of the
    same environment would have stored it: their host id in place of this one's, in the folder and in the id.
    Only the files that exist, in the hosts' name order; none where SPECTIE_OWN_RECORDS_ONLY=1 (a machine whose
    hardware no record names measures everything: `NEW_HOST=1 scripts/time_pipeline.sh` times that)."""
    path = Path(path)
    folder = path.parent.parent
    environment, _, host = folder.name.rpartition("-")
    if not HOST_ID_PATTERN.fullmatch(host) or _own_only():
        return []
    found = []
    for other in sorted(folder.parent.glob(f"{environment}-*")):
        other_environment, _, other_host = other.name.rpartition("-")
        candidate = other / path.parent.name / path.name.replace(host, other_host)
        if other_environment == environment and other_host != host and HOST_ID_PATTERN.fullmatch(other_host) \
                and candidate.is_file():
            found.append(candidate)
    return found


def kept_on_this_device(path: str | os.PathLike, same) -> Record | None:
    """A record to keep instead of writing one at `path`: this host's there, else another host's of identical
    hardware (`twin_paths`, `fingerprint.same_device`), where `same(record)` says it holds what would be written."""
    from spectie.records.fingerprint import same_device

    for candidate in (Path(path), *twin_paths(path)):
        record = read_if_valid(candidate)
        if record is not None and (candidate == Path(path) or same_device(record.fingerprint)) and same(record):
            return record
    return None


def standing_hosts(environment: str, results_dir: str | os.PathLike | None = None) -> list[str]:
    """The hosts whose records of `environment` stand for this machine: this host, then every other host whose
    records were made on identical hardware (`fingerprint.same_device`): what a build here reuses."""
    from spectie.records.fingerprint import host_id, same_device

    results_dir = Path(results_dir) if results_dir else project_root() / "results"
    hosts = [host_id()]
    for folder in sorted((results_dir / "measured").glob(f"{environment}-*")) if not _own_only() else ():
        name, _, host = folder.name.rpartition("-")
        if name != environment or host in hosts or not HOST_ID_PATTERN.fullmatch(host):
            continue
        record = next(filter(None, map(read_if_valid, sorted(folder.rglob(f"*{RECORD_SUFFIX}")))), None)
        if record is not None and record.fingerprint and same_device(record.fingerprint):
            hosts.append(host)
    return hosts


def standing_first(records: list[Record], environment: str) -> list[Record]:
    """`records`, those of the hosts standing for this machine in `environment` first (`standing_hosts`: this
    host's, then those of hosts of identical hardware), the rest after them in their order."""
    ours = standing_hosts(environment)
    rank = {host: i for i, host in enumerate(ours)}
    return sorted(records, key=lambda r: rank.get(r.fingerprint.host_id if r.fingerprint else None, len(ours))
                  if r.environment == environment else len(ours))


def record_paths(results_dir: str | os.PathLike | None = None, chapter: str | None = None,
                 provenance: str | None = None) -> list[Path]:
    """Every record file under results/ (temporary files of interrupted writes are not records), or only those of
    one `chapter` or `provenance`, found by where such records live (`misplaced` holds every record to it):
    reported records under results/reported/, measured ones in results/measured/<environment>-<host id>/<chapter>/."""
    results_dir = Path(results_dir) if results_dir else project_root() / "results"
    if chapter is None and provenance is None:
        found = results_dir.rglob(f"*{RECORD_SUFFIX}")
    else:
        found = [*((results_dir / "reported").rglob(f"*{RECORD_SUFFIX}") if provenance in (None, "reported") else ()),
                 *(results_dir.glob(f"measured/*/{chapter or '*'}/*{RECORD_SUFFIX}") if provenance in (None, "measured")
                   else ())]
    return sorted(p for p in found if not p.name.startswith("."))


def misplaced(record: dict, path: Path, results_dir: Path) -> str | None:
    """Why a valid record at `path` is not where records of its kind live (None where it is): a reported record
    belongs under results/reported/, a measured one at `measured_path`."""
    if record["provenance"] == "reported":
        return None if (results_dir / "reported") in path.parents else "a reported record outside results/reported/"
    expected = measured_path(record, results_dir)
    return None if path.resolve() == expected.resolve() else f"a measured record belongs at {expected}"


def check_records(results_dir: str | os.PathLike | None = None, chapter: str | None = None,
                  provenance: str | None = None) -> tuple[list[Record], list[RecordError]]:
    """Read every record file under results/ (or those of one chapter or provenance, `record_paths`); return the
    valid records and every problem found."""
    results_dir = Path(results_dir) if results_dir else project_root() / "results"
    records, problems, seen = [], [], {}
    for path in record_paths(results_dir, chapter, provenance):
        try:
            stored = read_stored(path)
            record = Record.from_dict(stored, where=str(path))
        except RecordError as exc:
            problems.append(exc)
            continue
        if record.id in seen:
            problems.append(RecordError(str(path), "id", f"{record.id!r} is also used by {seen[record.id]}"))
            continue
        where = misplaced(stored, path, results_dir)
        if where:
            problems.append(RecordError(str(path), "(file)", where))
            continue
        seen[record.id] = path
        records.append(record)
    return records, problems


def load_records(results_dir: str | os.PathLike | None = None, **match) -> list[Record]:
    """All records under results/, validated, optionally filtered by top-level fields (e.g. chapter=...). A chapter
    or a provenance is looked for only where such records live (`record_paths`).

    Raises RecordError for the first invalid file or duplicated id: nothing is silently skipped.
    """
    narrow = {key: match[key] for key in ("chapter", "provenance") if isinstance(match.get(key), str)}
    records, problems = check_records(results_dir, **narrow)
    if problems:
        raise problems[0]
    gone = superseded(records)
    return [r for r in records if r.id not in gone and all(getattr(r, key) == value for key, value in match.items())]


def superseded(records: list[Record]) -> set[str]:
    """Ids of records a machine made before the host id counted its hardware (no `cpu_flags`) that it has made again
    under its new id: a newer record of the same measurement (the same id, its host id part aside) whose
    `machine_id_hash` is the old record's host id, on the same CPU and GPU models. One machine is one host in the
    book: the new record replaces the old. (Machine images bake one machine id into many machines: a record of
    another CPU or GPU model under the same machine id is another machine's, and replaces nothing.)"""
    def slot(record: Record, host: str) -> tuple:
        fingerprint = record.fingerprint
        return host, fingerprint.cpu, fingerprint.gpu, record.id.replace(fingerprint.host_id, "{host}")

    since = {slot(r, r.fingerprint.machine_id_hash) for r in records
             if r.fingerprint and r.fingerprint.cpu_flags is not None and r.fingerprint.machine_id_hash}
    return {r.id for r in records if r.provenance == "measured" and r.fingerprint
            and r.fingerprint.cpu_flags is None and slot(r, r.fingerprint.host_id) in since}


def same_weights(record: Record, model: str) -> bool:
    """Whether `record` was made with the weights that `model` names here (same weights digest; a hub id
    that is not in this host's cache, with no digest, matches by name). Only such records may be re-scored with this model's weights:
    a record of another organism is shown, never re-scored with the pinned one."""
    from spectie.records.fingerprint import model_digest

    if getattr(record.parameters, "model", None) != model:
        return False
    return (record.fingerprint and record.fingerprint.model_sha256) == model_digest(model)


def provenance_line(records: list[Record]) -> str:
    """One line saying where the records behind a figure or table came from: how many are reported and
    measured, on which devices and hosts, from which project commits (dirty ones marked) and with which
    torch, transformers and vLLM. Unknown fields are said to be unknown, never left out."""
    reported = [r for r in records if r.provenance == "reported"]
    measured = [r for r in records if r.measured]
    parts = []
    if reported:
        parts.append(f"{len(reported)} reported (the incident)")
    if measured:
        prints = [r.fingerprint for r in measured]
        hosts = sorted({f"{f.gpu or 'CPU: ' + f.cpu} (host {f.host_id})" for f in prints})
        commits = sorted({"unknown" if not f.source_commit else
                          f.source_commit[:7] + (" (uncommitted changes)" if f.source_dirty else "")
                          for f in prints})

        def versions(key):
            return "/".join(sorted({str(getattr(f, key)) for f in prints if getattr(f, key)})) or "none"

        parts.append(f"{len(measured)} measured on {', '.join(hosts)}; commit {', '.join(commits)}; torch "
                     f"{versions('torch')}, transformers {versions('transformers')}, vLLM {versions('vllm')}")
    return "Records: " + ("; ".join(parts) if parts else "none") + "."
