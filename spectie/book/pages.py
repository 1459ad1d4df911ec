"""A chapter's page helpers: values glued by name for its text (`glue_all`), sentences as a Markdown list
(`bullets`), figures and long tables as HTML (alt text and a caption for a figure drawn in a loop, which a glued
figure directive cannot name one by one; a long table folded under a one-line summary)."""

from __future__ import annotations


def captioned(fig, alt: str, caption: str):
    """A matplotlib figure as an HTML figure with alt text and a caption."""
    import base64
    import html
    import io

    from IPython.display import HTML

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    image = base64.b64encode(buffer.getvalue()).decode("ascii")
    return HTML(f'<figure class="spectie-figure"><img src="data:image/png;base64,{image}" alt="{html.escape(alt)}" '
                f'style="max-width:100%"><figcaption>{html.escape(caption)}</figcaption></figure>')


def folded(table, summary: str):
    """A long table (a DataFrame or its Styler) folded under a one-line summary the reader opens."""
    import html

    from IPython.display import HTML

    return HTML(f"<details><summary>{html.escape(summary)}</summary>{table.to_html()}</details>")


def glue_all(values: dict, shown: tuple[str, ...] = ()) -> None:
    """Glue each value under its name for the page's text (`{glue:text}`name``) and figures; those named in `shown`
    are also shown where the cell stands (a table the page shows in place). A claim (`claims.Claim`) is glued as its
    text, and itself beside it (`<name>.claim`), for the claims test to check against every record."""
    from IPython.display import Markdown
    from myst_nb import glue

    from spectie.book.claims import SUFFIX, Claim

    for name, value in values.items():
        if isinstance(value, Claim):
            glue(name + SUFFIX, value.to_json(), display=False)
            value = Markdown(value.text) if value.markdown else value.text
        glue(name, value, display=name in shown)


def device_of(record) -> str:
    """Where a measured record ran, as the pages name it: environment, GPU (else CPU) and host."""
    f = record.fingerprint
    return f"{record.environment}, {f.gpu or f.cpu} (host {f.host_id})"


def bullets(lines: list[str]) -> str:
    """A Markdown list of sentences, each capitalised and ended."""
    return "\n".join(f"- {capitalised(line)}." for line in lines)


def capitalised(line: str) -> str:
    """The sentence with its first letter in upper case, unless its first word is a name spelled with a
    capital inside (vLLM) or an identifier (ngram_gpu)."""
    first = line.split(" ", 1)[0]
    return line if any(c.isupper() for c in first[1:]) or "_" in first else line[0].upper() + line[1:]


def and_list(items: list[str]) -> str:
    """"a", "a and b", "a, b and c"; "—" for none."""
    if not items:
        return "—"
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
