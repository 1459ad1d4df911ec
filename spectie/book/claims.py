"""Claims as data: a sentence of the book that states a count, an absence, a comparison or a verdict over runs,
kept with the scope it covers (which records) and the measure that computes what it states from those records.

A page glues a claim like any value (`pages.glue_all`): its text where the page shows it, and the claim itself
beside it (under `<name>.claim`), so the executed chapter carries every claim it made. The claims test reads them
back and evaluates each against every record under results/: the measure over the records in the claim's scope
must give the facts the sentence states. A claim whose scope names no records (empty `words`) covers every record
of its kind, so a sentence computed over a subset and worded as if it covered all fails there.

    claim = Claim("ends_text", text, Scope(words, "engine-outcome", environments=("cpu",)),
                  "spectie.book.guidance:ends_facts", facts)
    claim.holds(load_records())          # the measure over the scope's records gives `facts`
"""

from __future__ import annotations

import importlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from spectie.records.record_types import Record

SUFFIX = ".claim"  # the glue name of a claim beside its text's


@dataclass(frozen=True)
class Scope:
    """Which records a claim covers. Every field left empty matches any record; `words` is how the sentence names
    the scope ("" where the sentence names none: it then covers every record of `kind`)."""
    words: str
    kind: str = ""  # a record kind; "" : every kind
    provenance: str = ""  # "measured" or "reported"; "" : both
    environments: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    prompt_seeds: tuple[int, ...] = ()
    model_sha256: str = ""

    def covers(self, record: Record) -> bool:
        fingerprint = record.fingerprint
        seed = getattr(record.parameters, "prompt_seed", None)
        return ((not self.kind or record.kind == self.kind)
                and (not self.provenance or record.provenance == self.provenance)
                and (not self.environments or record.environment in self.environments)
                and (not self.hosts or (fingerprint is not None and fingerprint.host_id in self.hosts))
                and (not self.prompt_seeds or seed in self.prompt_seeds)
                and (not self.model_sha256 or (fingerprint is not None
                                               and fingerprint.model_sha256 == self.model_sha256)))

    def select(self, records: list[Record]) -> list[Record]:
        return [r for r in records if self.covers(r)]

    def unscoped(self) -> Scope:
        """The same kind of records, every one of them: what the sentence would claim without its scope."""
        return Scope("", self.kind, self.provenance)


def covering(records: list[Record], words: str, kind: str) -> Scope:
    """The scope of a sentence over measured `records` of `kind` (matrix runs, a survey): their environments,
    hosts, prompt seeds (of the records that have one) and weights."""
    seeds = {getattr(r.parameters, "prompt_seed", None) for r in records} - {None}
    return Scope(words, kind, "measured",
                 tuple(sorted({r.environment for r in records})),
                 tuple(sorted({r.fingerprint.host_id for r in records if r.fingerprint})),
                 tuple(sorted(seeds)),
                 next((r.fingerprint.model_sha256 for r in records if r.fingerprint and r.fingerprint.model_sha256), ""))


@dataclass(frozen=True)
class Claim:
    """A sentence (`text`, glued as `name`), the records it covers (`scope`), and the measure
    ("module:function", called with the scope's records and `arguments`) whose result is what it states (`facts`)."""
    name: str
    text: str
    scope: Scope
    measure: str
    facts: dict | list | str
    arguments: dict = field(default_factory=dict)
    markdown: bool = False  # the text is Markdown (a list of sentences), glued as such

    def measured(self, records: list[Record]) -> dict:
        module, _, function = self.measure.partition(":")
        return getattr(importlib.import_module(module), function)(self.scope.select(records), **self.arguments)

    def holds(self, records: list[Record]) -> bool:
        """Whether the measure over the records in scope gives the facts the sentence states (compared as JSON
        holds them: a claim read back from a page has lists where the measure may give tuples)."""
        return json.loads(json.dumps(self.measured(records))) == json.loads(json.dumps(self.facts))

    def names_its_scope(self) -> bool:
        return bool(self.scope.words) and self.scope.words in self.text

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Claim:
        stored = json.loads(text)
        scope = stored.pop("scope")
        return cls(scope=Scope(**{k: tuple(v) if isinstance(v, list) else v for k, v in scope.items()}), **stored)


def claims_in(notebook: str | Path) -> list[Claim]:
    """The claims an executed chapter glued (outputs named `<name>.claim`)."""
    import ast

    found = []
    for cell in json.loads(Path(notebook).read_text(encoding="utf-8"))["cells"]:
        for output in cell.get("outputs", []):
            name = output.get("metadata", {}).get("scrapbook", {}).get("name", "")
            if name.endswith(SUFFIX):  # glued as a string: its repr, under myst-nb's text/plain
                text = next(v for k, v in output["data"].items() if k.endswith("text/plain"))
                found.append(Claim.from_json(ast.literal_eval("".join(text))))
    return found


def commit_facts(records: list[Record]) -> dict:
    """How many of `records` are measured, and how many of those name the project commit that made them."""
    measured = [r for r in records if r.measured]
    return {"measured": len(measured),
            "with_commit": sum(bool(r.fingerprint and r.fingerprint.source_commit) for r in measured)}


def commit_claim(records: list[Record]) -> Claim:
    """How many measured records name the commit that made them, over every record (the sentence names no scope)."""
    facts = commit_facts(records)
    return Claim("commit_text", f"{facts['with_commit']} of the {facts['measured']} measured records also name the "
                 "project commit that made them", Scope("", provenance="measured"), "spectie.book.claims:commit_facts", facts)
