"""Report documents: tables, text and images rendered to Markdown and to one self-contained HTML page.

A document is a list of blocks (:class:`Heading`, :class:`Text`, :class:`Table`,
:class:`Image`). Markdown links images by relative path; HTML embeds them as base64
``data:`` URIs, so ``report.html`` needs no other file and loads nothing from outside.
"""
from __future__ import annotations

import base64
import html
import math
import re
from dataclasses import dataclass, field
from pathlib import Path


# ------------------------------------------------------------------------------ numbers
def fmt_ppl(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.2f}"


def pct_change(a: float | None, b: float | None) -> float | None:
    """Percent change from ``a`` to ``b`` (None when either is missing)."""
    if a is None or b is None or a == 0:
        return None
    return (b - a) / a * 100.0


def fmt_pct(x: float | None) -> str:
    return "—" if x is None else f"{x:+.1f} %"


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Text:
    text: str                  # plain text; blank lines separate paragraphs


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""
    bold: set = field(default_factory=set)     # (row, col) cells shown in bold

    def markdown(self) -> str:
        def esc(s):
            return str(s).replace("|", "\\|")
        lines = [f"**{self.title}**", "", "| " + " | ".join(esc(h) for h in self.header) + " |",
                 "|" + "|".join("---" for _ in self.header) + "|"]
        for r, row in enumerate(self.rows):
            cells = [f"**{esc(v)}**" if (r, c) in self.bold else esc(v) for c, v in enumerate(row)]
            lines.append("| " + " | ".join(cells) + " |")
        if self.note:
            lines += ["", self.note]
        return "\n".join(lines)

    def html(self) -> str:
        head = "".join(f"<th>{html.escape(str(h))}</th>" for h in self.header)
        body = []
        for r, row in enumerate(self.rows):
            cells = []
            for c, v in enumerate(row):
                text = html.escape(str(v))
                cells.append(f"<td><b>{text}</b></td>" if (r, c) in self.bold else f"<td>{text}</td>")
            body.append("<tr>" + "".join(cells) + "</tr>")
        note = f"<p class='note'>{inline_html(self.note)}</p>" if self.note else ""
        return (f"<h3>{html.escape(self.title)}</h3><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{''.join(body)}</tbody></table>{note}")


@dataclass
class Image:
    path: Path
    caption: str


Block = Heading | Text | Table | Image

STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:.9em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right;white-space:nowrap}
th:first-child,td:first-child{text-align:left}
thead{background:#f2f2f2} .note{color:#555;font-size:.9em} img{max-width:100%;border:1px solid #eee}
figure{margin:1em 0} figcaption{color:#555;font-size:.9em} pre{background:#f6f6f6;padding:.6em;overflow-x:auto}
"""


def to_markdown(title: str, blocks: list, out_dir: Path) -> str:
    parts = [f"# {title}"]
    for b in blocks:
        if isinstance(b, Heading):
            parts.append("#" * b.level + " " + b.text)
        elif isinstance(b, Text):
            parts.append(b.text)
        elif isinstance(b, Table):
            parts.append(b.markdown())
        elif isinstance(b, Image):
            rel = Path(b.path).resolve().relative_to(Path(out_dir).resolve()) \
                if Path(b.path).resolve().is_relative_to(Path(out_dir).resolve()) else Path(b.path)
            parts.append(f"![{b.caption}]({rel.as_posix()})\n\n*{b.caption}*")
    return "\n\n".join(parts) + "\n"


_CODE = re.compile(r"`([^`]+)`")
_STRONG = re.compile(r"\*\*(.+?)\*\*")


def inline_html(text: str) -> str:
    """Escaped ``text`` with the Markdown the report's prose uses: `code` and **bold**."""
    return _STRONG.sub(r"<strong>\1</strong>", _CODE.sub(r"<code>\1</code>", html.escape(text)))


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def to_html(title: str, blocks: list) -> str:
    parts = []
    for b in blocks:
        if isinstance(b, Heading):
            level = min(max(b.level, 1), 6)
            parts.append(f"<h{level}>{inline_html(b.text)}</h{level}>")
        elif isinstance(b, Text):
            for para in b.text.split("\n\n"):
                if para.startswith("```"):
                    body = para.strip("`").split("\n", 1)[-1]
                    parts.append(f"<pre>{html.escape(body)}</pre>")
                else:
                    parts.append(f"<p>{inline_html(para)}</p>")
        elif isinstance(b, Table):
            parts.append(b.html())
        elif isinstance(b, Image):
            parts.append(f"<figure><img alt='{html.escape(b.caption, quote=True)}' src='{_data_uri(b.path)}'>"
                         f"<figcaption>{html.escape(b.caption)}</figcaption></figure>")
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{''.join(parts)}</body></html>\n")
