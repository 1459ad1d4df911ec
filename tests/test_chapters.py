"""Chapters: parameters checked before any work, and staleness by content hash."""

import json

import nbformat
import pytest

from spectie.book.run import executed_path, is_stale, stale_reasons, stored_hash
from spectie.records.chapters import CHAPTERS, content_hash, get_chapter, load_parameters
from spectie.records.errors import UsageError


def test_an_unknown_chapter_lists_the_valid_ones():
    with pytest.raises(UsageError, match="unknown chapter 'nope'; valid chapters: incident, margins, reproduce, reduction_order, guidance, diagnose, environments"):
        get_chapter("nope")


def test_parameters_files(tmp_path):
    chapter = get_chapter("incident")
    good = tmp_path / "good.yaml"
    good.write_text("results_dir: results\n")
    assert load_parameters(chapter, good) == {"results_dir": "results"}
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("results_dir: results\nmodel: Qwen/Qwen3.5-2B\n")
    with pytest.raises(UsageError, match="has no parameter.*model.*valid parameters: results_dir"):
        load_parameters(chapter, unknown)
    broken = tmp_path / "broken.yaml"
    broken.write_text("results_dir: [unclosed\n")
    with pytest.raises(UsageError, match="does not parse"):
        load_parameters(chapter, broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(UsageError, match="must be a mapping"):
        load_parameters(chapter, listing)
    with pytest.raises(UsageError, match="does not exist"):
        load_parameters(chapter, tmp_path / "missing.yaml")


def test_the_content_hash_follows_every_input(project_copy):
    chapter = get_chapter("incident")
    appendix_base = content_hash(get_chapter("environments"), {})
    base, with_params = content_hash(chapter, {}), content_hash(chapter, {"results_dir": "elsewhere"})
    assert base == content_hash(chapter, {})  # deterministic
    assert base != with_params
    edits = [
        project_copy / chapter.notebook,  # the notebook
        project_copy / "spectie" / "book" / "incident.py",  # the package code
        project_copy / "results" / "reported" / "incident" / "b200-k7.json",  # an input record
    ]
    seen = {base}
    for path in edits:
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        changed = content_hash(chapter, {})
        assert changed not in seen, f"editing {path.name} did not change the hash"
        seen.add(changed)
        path.write_bytes(original)
        assert content_hash(chapter, {}) == base
    # A new record in another chapter's folder is not an input of the incident chapter...
    (project_copy / "results" / "measured" / "elsewhere").mkdir(parents=True)
    (project_copy / "results" / "measured" / "elsewhere" / "x.json").write_text("{}")
    assert content_hash(chapter, {}) == base
    # ...but it is one of the environments appendix.
    assert content_hash(get_chapter("environments"), {}) != appendix_base


def test_a_chapter_hashes_only_the_modules_it_uses_and_the_library_versions(project_copy, monkeypatch):
    """Editing the plots leaves the vLLM matrix up to date (it does not draw), not the margins chapter; a
    new torch version makes every chapter that computes stale."""
    from spectie.records import chapters

    reproduce, margins = get_chapter("reproduce"), get_chapter("margins")
    assert "plots.py" not in {p.name for p in chapters.used_modules(reproduce)}
    engines = {p.relative_to(project_copy).as_posix() for p in chapters.used_modules(reproduce)}
    assert {"spectie/engines/__init__.py", "spectie/engines/runner.py", "spectie/engines/child.py",
            "spectie/engines/matrix.py", "spectie/book/reproduce.py", "spectie/lab/model.py"} <= engines
    assert chapters._spectie_imports("from spectie.engines import runner\nimport spectie.lab.model\n"
                                     "from spectie.records.store import load_records") == \
        {"engines", "engines.runner", "lab", "lab.model", "records", "records.store", "records.store.load_records"}
    assert {"margins.py", "plots.py", "store.py"} <= {p.name for p in chapters.used_modules(margins)}
    before = content_hash(reproduce, {}), content_hash(margins, {})
    plots = project_copy / "spectie" / "book" / "plots.py"
    plots.write_text(plots.read_text() + "\n# edited\n")
    assert content_hash(reproduce, {}) == before[0] and content_hash(margins, {}) != before[1]
    plots.write_text(plots.read_text().removesuffix("\n# edited\n"))
    versions = chapters.library_versions()
    monkeypatch.setattr(chapters, "library_versions", lambda: {**versions, "torch": "0.0.0"})
    assert content_hash(reproduce, {}) != before[0] and content_hash(margins, {}) != before[1]



def test_a_runs_own_records_are_not_its_inputs(project_copy):
    """`make run ENV=...` writes records under its environment's folder: they must not change the hash its
    request keys hold, or an interrupted run can never resume (each call re-ran everything on the H200)."""
    from spectie.records.chapters import own_records_dir

    chapter, parameters = get_chapter("reproduce"), {"environment": "v0.26.0-h200"}
    base, build_base = content_hash(chapter, parameters), content_hash(chapter, {})
    own = project_copy / own_records_dir(chapter, "v0.26.0-h200")
    own.mkdir(parents=True, exist_ok=True)
    (own / "new-record.json").write_text("{}")
    assert content_hash(chapter, parameters) == base  # the run's own output
    assert content_hash(chapter, {}) != build_base  # another environment's record: an input of make build


def test_staleness_is_read_from_the_executed_copy(project_copy):
    chapter = CHAPTERS["incident"]
    assert is_stale(chapter)  # no executed copy yet
    copy = executed_path(chapter)
    copy.parent.mkdir(parents=True)
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["spectie"] = {"content_hash": content_hash(chapter, {})}
    nbformat.write(notebook, copy)
    assert stored_hash(copy) == content_hash(chapter, {})
    assert not is_stale(chapter)
    (project_copy / chapter.notebook).write_text((project_copy / chapter.notebook).read_text() + " ")
    assert is_stale(chapter)
    copy.write_text(json.dumps({"not": "a notebook"}))
    assert stored_hash(copy) is None and is_stale(chapter)


def test_a_chapter_is_not_stale_after_writing_its_own_records(project_copy):
    """The margins chapter reads every record (to list other hosts' runs) but its own records on this
    host are outputs: writing them does not make it stale; another host's new record does."""
    from spectie.records.fingerprint import host_id

    chapter = get_chapter("margins")
    before = content_hash(chapter, {})
    own = project_copy / "results" / "measured" / f"cpu-{host_id()}" / "margins"
    own.mkdir(parents=True, exist_ok=True)
    (own / "margins-cpu-decisive-x.json").write_text("{}")
    assert content_hash(chapter, {}) == before
    other = project_copy / "results" / "measured" / "h200-0123456789ab" / "margins"
    other.mkdir(parents=True, exist_ok=True)
    (other / "margins-h200-decisive-y.json").write_text("{}")
    after = content_hash(chapter, {})
    assert after != before
    # `make run ENV=laptop` on this host is a new column, not the build's own output: it makes it stale.
    run = project_copy / "results" / "measured" / f"laptop-{host_id()}" / "margins"
    run.mkdir(parents=True, exist_ok=True)
    (run / "margins-laptop-decisive-z.json").write_text("{}")
    assert content_hash(chapter, {}) != after


def test_the_diagnosis_is_not_stale_after_writing_its_records_into_its_own_results_folder(project_copy):
    """The diagnosis appendix writes its engines' records (chapter folder `reproduce`) under its own results folder:
    on a host new to the records a second build executed it again. Another host's diagnosis is still an input."""
    from spectie.records.chapters import notebook_parameters
    from spectie.records.fingerprint import host_id

    chapter = get_chapter("diagnose")
    assert chapter.results_dir == notebook_parameters(chapter)["results_dir"]
    before = content_hash(chapter, {})
    own = project_copy / chapter.results_dir / "measured" / f"cpu-{host_id()}" / "reproduce"
    own.mkdir(parents=True, exist_ok=True)
    (own / "reproduce-cpu-diagnose-x.json").write_text("{}")
    assert content_hash(chapter, {}) == before
    other = project_copy / chapter.results_dir / "measured" / "cpu-0123456789ab" / "reproduce"
    other.mkdir(parents=True, exist_ok=True)
    (other / "reproduce-cpu-diagnose-y.json").write_text("{}")
    assert content_hash(chapter, {}) != before


def _hashes(parameters=None) -> dict[str, str]:
    return {name: content_hash(chapter, parameters or {}) for name, chapter in CHAPTERS.items()}


def test_an_environment_file_is_an_input_only_of_the_chapters_that_read_it(project_copy):
    """Editing an environment's `pending` text re-executes the chapters that show it: the appendix and the first
    page (they show every environment), and the chapters whose records name it; no other."""
    base = _hashes()
    unrun = project_copy / "environments" / "v0.33.0-nvidia.yaml"  # named by no record
    unrun.write_text(unrun.read_text() + "pending: edited\n")
    assert {name for name, h in _hashes().items() if h != base[name]} == {"environments", "summary"}
    gpu = project_copy / "environments" / "v0.26.0-h200.yaml"  # named by the H200's reproduce records
    gpu.write_text(gpu.read_text() + "notes: edited\n")
    changed = {name for name, h in _hashes().items() if h != base[name]}
    assert changed == {"reproduce", "guidance", "environments", "summary"}
    # A run in an environment reads that environment, whatever its records.
    laptop = project_copy / "environments" / "laptop.yaml"
    laptop.write_text((project_copy / "environments" / "cpu.yaml").read_text().replace("id: cpu", "id: laptop", 1))
    margins = get_chapter("margins")
    before = content_hash(margins, {"environment": "laptop"})
    laptop.write_text(laptop.read_text() + "notes: edited\n")
    assert content_hash(margins, {"environment": "laptop"}) != before


def test_every_incident_environment_is_named_by_a_reported_record():
    """What makes "named" environments enough: chapters read the incident's environments (their releases and
    titles) through the reported records that name them."""
    from spectie.records.environments import load_environments
    from spectie.records.store import load_records

    named = {e for r in load_records(provenance="reported") for e in r.environments}
    incident = {e for e, env in load_environments().items() if env["named_in_incident"]}
    assert incident and incident <= named


def test_the_guidance_chapter_reads_the_margins_records_of_its_own_environment_only(project_copy):
    guidance = get_chapter("guidance")
    base = content_hash(guidance, {})
    other = project_copy / "results" / "measured" / "laptop-0123456789ab" / "margins"
    other.mkdir(parents=True)
    (other / "margins-laptop-decisive-x.json").write_text("{}")
    assert content_hash(guidance, {}) == base
    mine = project_copy / "results" / "measured" / "cpu-0123456789ab" / "margins"
    mine.mkdir(parents=True)
    (mine / "margins-cpu-decisive-x.json").write_text("{}")
    assert content_hash(guidance, {}) != base


def test_stale_reasons_name_the_inputs_that_changed(project_copy):
    chapter = CHAPTERS["incident"]
    assert stale_reasons(chapter) == ["no executed copy yet"]
    copy = executed_path(chapter)
    copy.parent.mkdir(parents=True)
    from spectie.records.chapters import input_digests

    notebook = nbformat.v4.new_notebook()
    notebook.metadata["spectie"] = {"content_hash": content_hash(chapter, {}), "inputs": input_digests(chapter, {})}
    nbformat.write(notebook, copy)
    assert stale_reasons(chapter) == []
    record = project_copy / "results" / "reported" / "incident" / "b200-k7.json"
    record.write_text(record.read_text() + "\n")
    (project_copy / "results" / "reported" / "incident" / "new.json").write_text("{}")
    assert stale_reasons(chapter) == ["changed: results/reported/incident/b200-k7.json",
                                      "new: results/reported/incident/new.json"]
