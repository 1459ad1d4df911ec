"""Figures and long tables as HTML for a chapter's page: alt text and a caption for a figure drawn in a loop
(which a glued figure directive cannot name one by one), a long table folded under a one-line summary."""

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
