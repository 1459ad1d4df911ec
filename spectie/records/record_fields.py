"""The building blocks of typed run records (spectie.records.record_types): a record's error, the named-fields base class
every kind's parameters and results derive from, and the two parts every record may carry whatever its kind: the
fingerprint of the machine that measured it and the source of a reported figure."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from spectie.records.errors import UsageError


class RecordError(UsageError):
    """A record that does not satisfy the schema or its kind's type; names the file and the field."""

    def __init__(self, where: str, field: str, problem: str):
        self.where, self.field, self.problem = where, field, problem
        super().__init__(f"{where}: field '{field}': {problem}")


@dataclass(frozen=True, kw_only=True)
class Fields:
    """Named fields read from a JSON object; every field is optional (None when the record leaves it out)."""

    @classmethod
    def from_dict(cls, data: dict, where: str = "<record>"):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise RecordError(where, unknown[0], f"not a field of {cls.__name__} (spectie/records/record_types.py)")
        return cls(**data)


def _optional(cls):
    """A frozen, keyword-only dataclass whose annotated fields all default to None."""
    for name in cls.__annotations__:
        if not hasattr(cls, name):
            setattr(cls, name, None)
    return dataclass(frozen=True, kw_only=True)(cls)


@_optional
class Fingerprint(Fields):
    """Where a measured record was made (fingerprint.environment_fingerprint)."""
    host_id: str
    machine_id_hash: str | None  # the host id of the machine id alone: what this machine's records were named before
    os: str
    cpu: str
    cpu_flags: list[str] | None
    gpu: str | None
    gpu_driver: str | None
    gpu_uuids: list[str] | None
    cuda: str | None
    python: str
    torch: str | None
    transformers: str | None
    vllm: str | None
    vllm_distribution: str | None
    vllm_platform: str | None
    dtype: str | None
    model_sha256: str | None
    model_revision: str | None
    source_commit: str | None
    source_dirty: bool | None
    entry_point: str | None


@_optional
class Source(Fields):
    """Where a reported record's figure was taken from."""
    title: str
    section: str
    document: str | None
    quote: str | None
