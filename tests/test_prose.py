"""The prose says only what the records say: no number typed into a notebook's or page's Markdown.

Numbers come from records through `{glue:...}` roles. What a reader may still see as digits outside glue:
identifiers (bf16, Qwen3.5, H200, top-2), issue numbers (#39273), list and section numbering, code (inline
or fenced: commands and parameters, not claims), and the few facts of formats and kernels listed in ALLOWED,
each with why it is not a record's figure.
"""

import json
import re

from conftest import ROOT


ALLOWED = {
    "8 significant bits": "bf16's format, not a measurement",
    "64-token chunks": "GDN's chunk size in the kernels (a constant of the code, not a figure)",
    "10⁻⁵": "where the plot draws a band of exactly 0 on its log axis (a drawing convention)",
    "RTX 4090": "a GPU's name",
}

_REMOVE = [
    # fenced blocks of code and glue directives; an admonition's body is prose and stays, its fence lines go
    re.compile(r"^(`{3,}|~{3,})(?!\{(admonition|important|note|warning|tip|seealso)\})[^\n]*\n[\s\S]*?^\1[ \t]*$", re.M),
    re.compile(r"^(`{3,}|~{3,}).*$", re.M),
    re.compile(r"^:[a-z-]+:.*$", re.M),  # directive options
    re.compile(r"^(    |\t).*$", re.M),  # indented code
    re.compile(r"\{[a-z:]+\}`[^`]*`"),  # roles: glue, doc, ref
    re.compile(r"`[^`]*`"),  # inline code
    re.compile(r"\]\([^)]*\)"),  # link targets
    re.compile(r"<[^>]+>"),  # html tags
    re.compile(r"#\d+"),  # issue and pull request numbers
    re.compile(r"^\s*(#+\s*)?\d+\.\s", re.M),  # list and section numbering
    re.compile(r"[\w.+-]*[A-Za-z][\w.+-]*"),  # words, with any digits inside them (bf16, Qwen3.5-2B, top-2)
]


def markdown_sources() -> list[tuple[str, str]]:
    sources = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                sources.append((f"{path.name} [{cell.get('id')}]", "".join(cell["source"])))
    for path in sorted((ROOT / "book").glob("*.md")):
        sources.append((path.name, path.read_text()))
    return sources


def typed_numbers(text: str) -> list[str]:
    """The lines of `text` that state a number outside glue, code and identifiers."""
    for phrase in ALLOWED:
        text = text.replace(phrase, "")
    stripped = text
    for pattern in _REMOVE:  # blanked, not deleted: the lines stay aligned with the original's
        stripped = pattern.sub(lambda match: re.sub(r"[^\n]", " ", match.group(0)), stripped)
    flagged = []
    for original, line in zip(text.splitlines(), stripped.splitlines()):
        if re.search(r"\d", line):
            flagged.append(original.strip())
    return flagged


def test_the_scan_finds_a_typed_number_and_passes_glued_ones():
    assert typed_numbers("the B200 stopped at K = 7 and not at K = 8") == ["the B200 stopped at K = 7 and not at K = 8"]
    assert typed_numbers("listings of 256 to 1536 tokens") == ["listings of 256 to 1536 tokens"]
    assert typed_numbers("K = {glue:text}`b200_k_stops` on B200 in bf16 (#39273), `max_tokens: 96`") == []
    assert typed_numbers("## 1. Set up\n1. **Is it deterministic?**") == []


def test_no_markdown_types_a_number():
    flagged = [f"{where}: {line}" for where, text in markdown_sources() for line in typed_numbers(text)]
    assert not flagged, "numbers typed into the prose (glue them from a record):\n" + "\n".join(flagged)
