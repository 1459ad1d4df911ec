"""Environments: one YAML file per place the experiment was (or can be) run, in environments/."""

from __future__ import annotations

from pathlib import Path

import yaml

from spectie.records.errors import UsageError
from spectie.records.paths import project_root
from spectie.records.record_types import Record

REQUIRED_KEYS = {"id", "title", "named_in_incident", "vllm", "hardware", "software", "install", "notes"}

STATUS_MEASURED = "measured here"
STATUS_REPORTED = "reported only"
STATUS_NOT_RUN = "not yet run"


def environments_dir() -> Path:
    return project_root() / "environments"


def load_environments() -> dict[str, dict]:
    """All environments by id, each checked for the keys the book needs."""
    environments = {}
    for path in sorted(environments_dir().glob("*.yaml")):
        env = yaml.safe_load(path.read_text())
        if not isinstance(env, dict):
            raise UsageError(f"{path}: not a mapping")
        missing = REQUIRED_KEYS - env.keys()
        if missing:
            raise UsageError(f"{path}: missing keys {sorted(missing)}")
        if env["id"] != path.stem:
            raise UsageError(f"{path}: id {env['id']!r} does not match the file name {path.stem!r}")
        environments[env["id"]] = env
    return environments


def get_environment(name: str) -> dict:
    """The environment called `name`; an unknown name raises with the list of valid ones."""
    environments = load_environments()
    if name not in environments:
        raise UsageError(f"unknown environment {name!r}; valid environments: {', '.join(environments)}")
    return environments[name]


def release(version: str | None) -> str | None:
    """A vLLM version as its release, without a local build label: '0.32.0+cpu' -> '0.32.0'."""
    return version.split("+")[0] if version else None


def incident_releases(environments: dict[str, dict]) -> list[str]:
    """The vLLM releases of the incident's environments (a nightly commit is no release)."""
    return sorted({release(env["vllm"].get("version")) for env in environments.values()
                   if env["named_in_incident"] and env["vllm"].get("version")})


def gpu_releases(records: list[Record]) -> list[str]:
    """The vLLM releases that ran an engine here on a GPU (measured engine outcomes)."""
    return sorted({release(r.fingerprint.vllm) for r in records
                   if r.measured and r.kind == "engine-outcome" and r.fingerprint.gpu and r.fingerprint.vllm})


def environment_status(env_id: str, records: list[Record]) -> str:
    """What the book says of an environment, derived from the records (never stored by hand)."""
    if any(r.measured and env_id in r.environments for r in records):
        return STATUS_MEASURED
    if any(r.provenance == "reported" and env_id in r.environments for r in records):
        return STATUS_REPORTED
    return STATUS_NOT_RUN


def pending_text(env: dict, records: list[Record]) -> str | None:
    """Why an environment that has a plan has no record yet (its file's `pending`), while that stays true."""
    if env.get("pending") and environment_status(env["id"], records) == STATUS_NOT_RUN:
        return " ".join(env["pending"].split())
    return None


def check_record_environments(records: list[Record]) -> list[str]:
    """Problems: records that name an environment with no file in environments/."""
    known = load_environments()
    return [
        f"record {r.id!r} names unknown environment {env!r}"
        for r in records
        for env in r.environments
        if env not in known
    ]


def require_described(records: list[Record]) -> None:
    """A UsageError naming every record whose environment no file in environments/ describes (a page stops there)."""
    problems = check_record_environments(records)
    if problems:
        raise UsageError("records name environments that environments/ does not describe:\n" + "\n".join(problems))


def environments_table(records: list[Record]):
    """One row per environment: what it is, how to install it, and its status from the records."""
    import pandas as pd

    rows = []
    for env in load_environments().values():
        vllm = env["vllm"]
        hardware = env["hardware"]
        gpus = hardware.get("gpu") or "none (CPU)"
        if hardware.get("gpu_count") and hardware["gpu_count"] > 1:
            gpus = f"{hardware['gpu_count']} × {gpus}"
        rows.append({
            "environment": env["id"],
            "description": env["title"],
            "vLLM": vllm.get("version") or (f"commit {vllm['commit']}" if vllm.get("commit") else "not installed"),
            "hardware": gpus,
            "named in the incident": "yes" if env["named_in_incident"] else "no",
            "status": environment_status(env["id"], records),
            "records": sum(env["id"] in r.environments for r in records),
        })
    return pd.DataFrame(rows).set_index("environment")


def page_values(records: list[Record]) -> dict:
    """The environments appendix's glue values: every environment with its records (a table) and the counts; a
    record that names an environment no file describes stops the page (UsageError)."""
    from collections import Counter

    from spectie.records.store import provenance_line

    require_described(records)
    table = environments_table(records)
    counts = Counter(r.provenance for r in records)
    return {"environments_table": table.reset_index().style.hide(axis="index"),  # cells whole, not cut
            "n_reported": counts["reported"], "n_measured": counts["measured"], "n_environments": len(table),
            "environments_provenance": provenance_line(records)}


def sections_markdown(records: list[Record]) -> str:
    """Each environment as a Markdown section: its notes, what is not run yet, how to install it, its details."""
    sections = []
    for env in load_environments().values():
        details = {key: env[key] for key in ("vllm", "hardware", "software")}
        pending = pending_text(env, records)
        sections.append(f"### `{env['id']}`: {env['title']}\n\n{env['notes']}\n\n"
                        + (f"**Not yet run:** {pending}\n\n" if pending else "")
                        + "```bash\n" + "\n".join(env["install"]) + "\n```\n\n"
                        + "```yaml\n" + yaml.safe_dump(details, sort_keys=False) + "```\n")
    return "\n".join(sections)
