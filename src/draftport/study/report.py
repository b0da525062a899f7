"""report.md + a self-contained report.html (PNG plots inlined as data URIs) from a list of sections.

The report is data, not code: a `Report` holds sections of paragraphs, tables and images; the two
renderers below turn it into Markdown (images linked beside it) and HTML (images embedded, so the
file can be mailed or opened from anywhere). No template engine: the structure is small and fixed.
"""

from __future__ import annotations

import base64
import html
import math
import os
import re
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal

from draftport.errors import bad_input
from draftport.safeio import atomic_write_bytes, atomic_write_json


def fmt(v, spec: str = "{:.2f}") -> str:
    """A figure as text, "–" when it is missing (reports and the verbs' terminal tables alike)."""
    return "–" if v is None else spec.format(v)


def decimals(value: float | None, lo: float | None = None, hi: float | None = None, sig: int = 3) -> int:
    """Decimal places a figure can carry. A median over repeats: those of the leading digit of half its min–max
    range (the digits below it are noise), but never fewer than two significant digits of the median itself (its
    range, printed beside it, says the rest); a figure without a range (or with none in it): `sig` significant
    digits. Negative means tens, hundreds, … (173.1 over 167.2–179.4: 0; 647 over 600–900: -1, "650")."""
    lead = None if not value else math.floor(math.log10(abs(value)))
    if lo is not None and hi is not None and hi > lo:
        spread = -math.floor(math.log10((hi - lo) / 2))
        return spread if lead is None else max(spread, 1 - lead)
    return 0 if lead is None else sig - 1 - lead


def rounded(value: float, places: int) -> float:
    """value rounded half up (as a reader rounds: 105 to tens is 110) to `places` decimal places; negative
    places round to tens, hundreds, …"""
    return float(Decimal(repr(float(value))).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP))


def at(value: float | None, places: int) -> str:
    """value rounded (rounded) to `places` decimal places as text; "–" when missing."""
    if value is None:
        return "–"
    return f"{rounded(value, places):.{max(places, 0)}f}"


def figure(value: float | None, lo: float | None = None, hi: float | None = None, sig: int = 3) -> str:
    """A measured figure to the precision its spread supports (decimals): 173.1 over 167.2–179.4 → "173",
    5.657 over 5.496–5.657 → "5.66", 0.742 over 0.6–4.8 → "0.74"; without a range, `sig` significant digits
    (195.07 → "195")."""
    return at(value, decimals(value, lo, hi, sig))


@dataclass
class Table:
    columns: list[str]                 # header cells
    rows: list[list[object]]           # cells; floats are formatted with `float_format`
    caption: str = ""
    float_format: str = "{:.3g}"


@dataclass
class Image:
    path: str                          # PNG file, relative to the report directory or absolute
    caption: str = ""


@dataclass
class Section:
    title: str
    paragraphs: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    images: list[Image] = field(default_factory=list)


@dataclass
class Report:
    title: str
    summary: list[str] = field(default_factory=list)    # the answer first: a few sentences at the top
    sections: list[Section] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)   # shown in the summary, after its first sentence


_NUMBER = re.compile(r"[-+]?[0-9][0-9,]*(\.[0-9]+)?%?")


def _numeric(value: object) -> bool:
    """A cell to right-align: a number, or a figure already formatted as text ("173", "+4%")."""
    return isinstance(value, (int, float)) or (isinstance(value, str) and bool(_NUMBER.fullmatch(value)))


def _cell(value: object, float_format: str) -> str:
    if isinstance(value, float):
        return float_format.format(value)
    if value is None:
        return "–"
    return str(value)


def render_markdown(report: Report) -> str:
    lines = [f"# {report.title}", ""]
    summary = report.summary[:1] + [f"**Warning:** {w}" for w in report.warnings] + report.summary[1:]
    for p in summary:  # one paragraph each
        lines += [p, ""]
    for sec in report.sections:
        lines += [f"## {sec.title}", ""]
        for p in sec.paragraphs:
            lines += [p, ""]
        for t in sec.tables:
            if t.caption:
                lines += [f"*{t.caption}*", ""]
            lines.append("| " + " | ".join(t.columns) + " |")
            lines.append("|" + "---|" * len(t.columns))
            for row in t.rows:
                lines.append("| " + " | ".join(_cell(c, t.float_format) for c in row) + " |")
            lines.append("")
        for im in sec.images:
            lines += [f"![{im.caption}]({im.path})", ""]
    return "\n".join(lines)


def _data_uri(png_path: str) -> str:
    with open(png_path, "rb") as f:
        data = f.read()
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise bad_input(png_path, "not a PNG file")
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#1b1b1b}
h1{font-size:1.7em}h2{margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;margin:.6em 0 1.2em}th,td{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top}td.num{text-align:right}
th{background:#f3f3f3}
figure{margin:1em 0}img{max-width:100%;border:1px solid #eee}figcaption{color:#555;font-size:.9em}
.summary{background:#f6f8fa;border-left:4px solid #2f6feb;padding:.6em 1em}
.summary p.verdict{font-size:1.15em;font-weight:600}
.summary p.warning{background:#fff8e1;border-left:4px solid #d4a72c;padding:.4em .7em}
"""


def render_html(report: Report, base_dir: str) -> str:
    esc = html.escape
    out = ["<!DOCTYPE html>", "<html lang=\"en\"><head><meta charset=\"utf-8\">",
           f"<title>{esc(report.title)}</title><style>{_CSS}</style></head><body>",
           f"<h1>{esc(report.title)}</h1>"]
    if report.summary or report.warnings:
        paras = [f"<p class=\"verdict\">{esc(s)}</p>" for s in report.summary[:1]]
        paras += [f"<p class=\"warning\"><strong>Warning:</strong> {esc(w)}</p>" for w in report.warnings]
        paras += [f"<p>{esc(s)}</p>" for s in report.summary[1:]]
        out.append("<div class=\"summary\">" + "".join(paras) + "</div>")
    for sec in report.sections:
        out.append(f"<h2>{esc(sec.title)}</h2>")
        out += [f"<p>{esc(p)}</p>" for p in sec.paragraphs]
        for t in sec.tables:
            out.append("<table>")
            if t.caption:
                out.append(f"<caption>{esc(t.caption)}</caption>")
            out.append("<tr>" + "".join(f"<th>{esc(c)}</th>" for c in t.columns) + "</tr>")
            for row in t.rows:
                out.append("<tr>" + "".join(
                    ('<td class="num">' if _numeric(c) else "<td>") + esc(_cell(c, t.float_format)) + "</td>"
                    for c in row) + "</tr>")
            out.append("</table>")
        for im in sec.images:
            path = im.path if os.path.isabs(im.path) else os.path.join(base_dir, im.path)
            out.append(f"<figure><img src=\"{_data_uri(path)}\" alt=\"{esc(im.caption)}\">"
                       f"<figcaption>{esc(im.caption)}</figcaption></figure>")
    out.append("</body></html>")
    return "\n".join(out)


def write_report(report: Report, out_dir: str) -> tuple[str, str]:
    """Write report.md and report.html into `out_dir` (images resolved relative to it)."""
    os.makedirs(out_dir, exist_ok=True)
    md_path = os.path.join(out_dir, "report.md")
    html_path = os.path.join(out_dir, "report.html")
    atomic_write_bytes(md_path, render_markdown(report).encode("utf-8"))
    atomic_write_bytes(html_path, render_html(report, out_dir).encode("utf-8"))
    return md_path, html_path


def publish_table(out_dir: str, stem: str, md: str, data: dict) -> None:
    """A study script's result: `stem`.md (the table a reader reads) and `stem`.json (the figures behind
    it) written into out_dir, and the markdown printed, for a run whose stdout is all that comes back."""
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_bytes(os.path.join(out_dir, f"{stem}.md"), md.encode("utf-8"))
    atomic_write_json(os.path.join(out_dir, f"{stem}.json"), data)
    print(md)
