"""report.md / report.html: content round trip, self-contained HTML, and a real headless-browser render."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from draftport.errors import DraftportError
from draftport.study.report import Image, Report, Section, Table, render_markdown, write_report


def _plot(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3), dpi=80)
    ax.plot([50, 200, 800], [1.6, 2.1, 2.5], marker="o", label="transfer")
    ax.plot([50, 200, 800], [1.2, 1.7, 2.2], marker="s", label="scratch")
    ax.set_xscale("log")
    ax.legend()
    fig.savefig(path)
    plt.close(fig)


def _report(tmp_path) -> Report:
    _plot(str(tmp_path / "tau.png"))
    return Report(
        title="Port study <A→B>",
        summary=["Transfer wins: τ 2.5 vs 2.2 at 800 samples."],
        sections=[Section("Data scaling", paragraphs=["τ against data size."],
                          tables=[Table(["drafter", "samples", "τ"], [["transfer", 800, 2.5], ["scratch", 800, 2.2]])],
                          images=[Image("tau.png", "τ vs data size")])],
    )


def test_markdown_and_html_carry_the_numbers(tmp_path):
    md_path, html_path = write_report(_report(tmp_path), str(tmp_path))
    md = open(md_path, encoding="utf-8").read()
    assert "| transfer | 800 | 2.5 |" in md and "![τ vs data size](tau.png)" in md
    page = open(html_path, encoding="utf-8").read()
    # Self-contained: the plot is inlined, nothing refers to a file beside it; titles are escaped.
    assert "data:image/png;base64," in page and 'src="tau.png"' not in page
    assert "Port study &lt;A→B&gt;" in page


def test_non_png_image_is_a_one_line_error(tmp_path):
    (tmp_path / "fake.png").write_text("not a png")
    rep = Report("r", sections=[Section("s", images=[Image("fake.png")])])
    with pytest.raises(DraftportError, match="fake.png: not a PNG file"):
        write_report(rep, str(tmp_path))


def test_markdown_formats_floats_and_missing_values():
    rep = Report("r", sections=[Section("s", tables=[Table(["a", "b"], [[1.23456, None]])])])
    assert "| 1.23 | – |" in render_markdown(rep)


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.mark.skipif(_chromium() is None and not os.environ.get("CI"), reason="Debian chromium not installed")
def test_html_renders_in_headless_chromium_with_its_plot(tmp_path):
    """Screenshot the report in Debian's chromium; the plot must paint coloured pixels (not blank)."""
    browser = _chromium()
    assert browser, "CI installs Debian's chromium (.ci/run); it is missing"
    _, html_path = write_report(_report(tmp_path), str(tmp_path))
    shot = tmp_path / "shot.png"
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,900",
           f"--screenshot={shot}", f"file://{html_path}"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    from PIL import Image as PILImage

    img = PILImage.open(shot).convert("RGB")
    colours = img.getcolors(maxcolors=1 << 20) or []
    # A blank page has one or two colours; text + a two-line matplotlib plot has hundreds, and the
    # plot's default blue (#1f77b4) must be among them — i.e. the inlined PNG was decoded and drawn.
    assert len(colours) > 50
    blue = sum(n for n, (r, g, b) in colours if abs(r - 31) < 30 and abs(g - 119) < 30 and abs(b - 180) < 30)
    assert blue > 20


def test_committed_gpu_study_renders_with_every_plot_in_chromium(tmp_path, chromium_images):
    """docs/gpu-study's summary.json (the committed GPU study) renders through today's study_report, and
    the resulting report.html shows each of its plots in a browser: each image decoded, none broken."""
    import json
    from pathlib import Path

    from draftport.study.study import study_report

    summary = Path(__file__).resolve().parents[2] / "docs" / "gpu-study" / "summary.json"
    md, html = study_report(json.loads(summary.read_text()), str(tmp_path))
    page = Path(html).read_text()
    drawn = chromium_images(html)
    assert len(drawn) == page.count("<img") >= 3 and "broken" not in drawn, drawn
    assert "τ" in Path(md).read_text()


def test_figures_carry_the_digits_their_spread_supports():
    from draftport.study.report import decimals, figure, rounded

    assert figure(173.1, 167.2, 179.4) == "173"      # ± 6 ms: whole milliseconds
    assert figure(5.657, 5.496, 5.657) == "5.66"     # ± 0.08: hundredths
    assert figure(647.0, 600.0, 900.0) == "650"      # ± 150: hundreds, but two digits of the median at least
    assert figure(0.742, 0.6, 4.8) == "0.74" and figure(1400.0, 1400.0, 2100.0) == "1400"
    assert figure(105.0, 90.0, 130.0) == "110"       # rounded half up, as a reader rounds
    assert figure(195.07) == "195" and figure(0.97) == "0.970" and figure(12345.0) == "12300"  # no range: 3 digits
    assert figure(2.0, 2.0, 2.0) == "2.00" and figure(0.0) == "0" and figure(None) == "–"
    assert decimals(11.92, 11.62, 11.96) == 1 and rounded(0.125, 2) == 0.13


def test_warnings_and_the_verdict_lead_the_summary(tmp_path):
    rep = Report("r", summary=["Prompt lookup is the fastest here.", "Details."], warnings=["Other work shared it."],
                 sections=[Section("1. s", tables=[Table(["a", "b"], [["x", "173"]])])])
    md_path, html_path = write_report(rep, str(tmp_path))
    md = open(md_path, encoding="utf-8").read()
    assert md.index("fastest here") < md.index("**Warning:** Other work") < md.index("Details.") < md.index("## 1. s")
    page = open(html_path, encoding="utf-8").read()
    summary = page.split('<div class="summary">')[1].split("</div>")[0]
    assert summary.index('class="verdict"') < summary.index('class="warning"') < summary.index("Details.")
    assert '<td class="num">173</td>' in page   # a figure formatted as text still aligns as a number


def test_predicted_bars_are_drawn_as_predictions(tmp_path):
    """The tok/s chart: a predicted bar is pale and hatched, with a legend and a note saying it is not measured."""
    from PIL import Image as PILImage

    from draftport.study.plots import MEASURED_COLOUR, PREDICTED_COLOUR, plot_bars

    bars = {"no speculation": 11.8, "drafter": 5.6, "prompt lookup": 18.8, "predicted (drafter)": 24.0}
    png = plot_bars(bars, tmp_path / "b.png", title="t", ylabel="tok/s", predicted=["predicted (drafter)"],
                    note="predicted: not a measurement")
    def count(path, hexrgb):
        rgb = tuple(int(hexrgb[i:i + 2], 16) for i in (1, 3, 5))
        return sum(n for n, c in PILImage.open(path).convert("RGB").getcolors(maxcolors=1 << 20) if c == rgb)

    assert count(png, PREDICTED_COLOUR) > 500 and count(png, MEASURED_COLOUR) > 2000
    plain = plot_bars({k: v for k, v in bars.items() if k != "predicted (drafter)"}, tmp_path / "p.png", title="t",
                      ylabel="tok/s")
    assert count(plain, PREDICTED_COLOUR) == 0 and count(plain, MEASURED_COLOUR) > 2000
    with pytest.raises(DraftportError, match="predicted bars"):
        plot_bars({"a": 1.0}, tmp_path / "x.png", title="t", ylabel="y", predicted=["b"])
