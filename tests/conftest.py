"""Shared fixtures. Tiny random models are built in code; the real Gemma-3-270M is loaded once per session."""

from __future__ import annotations

import os
from pathlib import Path

# One intra-op thread: the tests run tiny models, where a second thread costs more in hand-offs than
# it gains (a tiny training loop runs many times slower with more threads on a small CPU); set before
# torch loads so subprocesses (torchrun, killed-and-resumed runs) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def pytest_addoption(parser):
    # the full hostile-input run: 1,200 cases per reader instead of CI's few dozen;
    # DRAFTPORT_FUZZ_EXAMPLES=N sets the number per reader directly
    parser.addoption("--fuzz-full", action="store_true", default=False,
                     help="run tests/check/test_fuzz.py with 1,200 generated cases per reader (by hand, minutes)")
    # the full killed-run campaign: 12 SIGKILLs of `python -m draftport capture` and of
    # `... train` at random points instead of CI's 3 each (of forked children)
    parser.addoption("--reliability-full", action="store_true", default=False,
                     help="run tests/train/test_reliability.py's kill campaign in full (by hand, minutes)")


def reference_module(name: str):
    """Import a package a test checks draftport against (a reference loader such as speculators).
    Off CI a missing reference skips the test; under CI (CI=true), whose .ci/run installs every
    reference, it fails it: a reference test that silently skips proves nothing."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"reference package {name} cannot be imported under CI: {exc}", pytrace=False)
        pytest.skip(f"reference package {name} not installed: {exc}", allow_module_level=True)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def gemma_target():
    """The embedded default target (Gemma-3-270M, fp32, CPU), loaded once for the whole test run."""
    from draftport.model.target import load_target

    return load_target("gemma-3-270m", device="cpu", dtype="fp32")


def pytest_collection_modifyitems(config, items):
    import importlib.util

    has_cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        has_cuda = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# What a page runs once loaded: each <img>'s decoded size in the browser ("broken" when it did not decode),
# appended to the DOM that --dump-dom prints.
_IMAGE_PROBE = ("<script>window.addEventListener('load', () => { const r = Array.from(document.images).map(i => "
                "(i.complete && i.naturalWidth > 0) ? i.naturalWidth + 'x' + i.naturalHeight : 'broken'); "
                "const p = document.createElement('pre'); p.id = 'draftport-images'; p.textContent = r.join(' '); "
                "document.body.appendChild(p); });</script>")


@pytest.fixture
def chromium_images(tmp_path_factory):
    """f(html_path) -> the decoded size of every image of the page, as Debian's headless chromium drew it
    ("781x466", or "broken"). Off CI a missing chromium skips the test; under CI (.ci/run installs it) it fails."""
    import re
    import shutil
    import subprocess

    browser = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("CI installs Debian's chromium (.ci/run); it is missing", pytrace=False)
        pytest.skip("Debian chromium not installed")
    work = tmp_path_factory.mktemp("chromium")

    def images(html_path) -> list[str]:
        html = Path(html_path).read_text(encoding="utf-8")
        page = Path(html_path).with_name(f".probe-{Path(html_path).name}")  # beside it: relative links still resolve
        page.write_text(html.replace("</body>", _IMAGE_PROBE + "</body>") if "</body>" in html
                        else html + _IMAGE_PROBE, encoding="utf-8")
        try:
            res = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                                  "--no-first-run", "--disable-background-networking", "--disable-component-update",
                                  "--disable-sync", f"--user-data-dir={work / 'profile'}", "--virtual-time-budget=5000",
                                  "--dump-dom", f"file://{page.resolve()}"],
                                 check=True, capture_output=True, text=True, timeout=120)
        finally:
            page.unlink()
        found = re.findall(r'<pre id="draftport-images">(.*?)</pre>', res.stdout, flags=re.S)
        assert found, f"the page's load handler did not run in chromium: {html_path}"
        return found[0].split()

    return images
