"""The book: notebooks paired and in sync, the Colab install cell, the built pages in a real browser."""

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import jupytext
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.md"))
CHAPTERS = [p.stem for p in NOTEBOOKS]


def cells(path):
    nb = jupytext.read(path)
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_there_are_ten_chapters_and_all_are_in_the_toc():
    assert len(NOTEBOOKS) == 10
    toc = (ROOT / "_toc.yml").read_text()
    for stem in CHAPTERS:
        assert f"notebooks/{stem}" in toc


@pytest.mark.parametrize("md", NOTEBOOKS, ids=CHAPTERS)
def test_markdown_and_notebook_are_paired_and_in_sync(md):
    ipynb = md.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} is missing: run `jupytext --sync {md.relative_to(ROOT)}`"
    assert cells(md) == cells(ipynb), f"{md.name} and {ipynb.name} differ: run `jupytext --sync`"
    assert "ipynb,md:myst" in md.read_text().split("---")[1]


@pytest.mark.parametrize("md", NOTEBOOKS, ids=CHAPTERS)
def test_committed_notebook_is_executed(md):
    nb = jupytext.read(md.with_suffix(".ipynb"))
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code), "commit executed notebooks: `make notebooks`"


def install_cell(md):
    return next(c.source for c in jupytext.read(md).cells if c.cell_type == "code")


def test_every_notebook_installs_from_the_repository_url_in_config():
    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    first = {install_cell(md) for md in NOTEBOOKS}
    assert len(first) == 1, "every chapter starts with the same setup cell"
    assert f"git+{url}" in first.pop()


@pytest.mark.slow
def test_colab_like_environment_installs_the_package(tmp_path):
    """A Python that has torch and friends but not posenc_lab, as on Colab: the first cell installs it."""
    venv = tmp_path / "colab"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = subprocess.run([sys.executable, "-c", "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies are importable (a plain path entry: the editable install's .pth is not processed)
    Path(site, "colab_preinstalled.pth").write_text(ours + "\n")
    probe = "import importlib.util; print(importlib.util.find_spec('posenc_lab') is None)"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    before = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert before.stdout.strip() == "True", "the simulated Colab already has posenc_lab"
    cell = install_cell(NOTEBOOKS[0])
    check = cell + "\nimport posenc_lab\nprint('device', device, 'posenc_lab', posenc_lab.__version__, posenc_lab.__file__)\n"
    # no network here: the same cell, pointed at this checkout instead of the repository URL
    env["POSENC_LAB_SOURCE"] = str(ROOT)
    result = subprocess.run([str(py), "-c", check], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "device cpu posenc_lab 0.1.0" in result.stdout and str(venv) in result.stdout


class PageScan(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.math, self.text, self.colab = [], 0, [], []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        if tag == "mjx-container":
            self.math += 1
        if tag in ("script", "style"):
            self._skip += 1
        if tag == "a" and "colab.research.google.com" in attrs.get("href", ""):
            self.colab.append(attrs["href"])

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.text.append(data)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def built_book(tmp_path_factory):
    out = tmp_path_factory.mktemp("book")
    subprocess.run(["make", "-s", "mathjax"], cwd=ROOT, check=True)
    jupyter_book = Path(sys.executable).parent / "jupyter-book"
    result = subprocess.run([str(jupyter_book), "build", str(ROOT), "--path-output", str(out), "-W", "-n", "--keep-going"],
                            capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return out / "_build" / "html"


@pytest.mark.slow
def test_book_pages_in_a_real_browser(built_book):
    browser = chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs it with apt-get)")
        pytest.skip("chromium not installed: apt-get install chromium")
    for stem in CHAPTERS:
        page = built_book / "notebooks" / f"{stem}.html"
        assert page.exists(), f"{page} was not built"
        dom = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={built_book.parent / ('chrome-' + stem)}", "--virtual-time-budget=15000",
             "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=180).stdout
        scan = PageScan()
        scan.feed(dom)
        text = " ".join(scan.text)
        source = (ROOT / "notebooks" / f"{stem}.md").read_text()
        if "$" in source:
            assert scan.math > 0, f"{stem}: its math was not typeset by MathJax"
        for raw in ("\\(", "\\[", "$$"):
            assert raw not in text, f"{stem}: raw TeX {raw!r} left on the page"
        for marker in ("Traceback", "Error:", "NameError", "ModuleNotFoundError"):
            assert marker not in text, f"{stem}: {marker!r} on the page"
        figures = [src for src in scan.images if "_images/" in src]
        for src in figures:
            image = (page.parent / src).resolve()
            assert image.exists() and image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{stem}: figure {src} does not load"
        assert scan.colab and all(h.endswith(f"notebooks/{stem}.ipynb") for h in scan.colab), f"{stem}: Colab link {scan.colab}"
        if "plt.show()" in source:
            assert figures, f"{stem}: draws figures but none is on the page"


@pytest.mark.slow
def test_references_page_lists_every_cited_paper(built_book):
    bib = (ROOT / "book" / "references.bib").read_text()
    keys = set(re.findall(r"@\w+\{([^,]+),", bib))
    cited = set()
    for md in NOTEBOOKS:
        cited |= set(re.findall(r"\{cite\}`([^`]+)`", md.read_text()))
    assert cited <= keys, f"cited but not in the bibliography: {cited - keys}"
    html = (built_book / "book" / "references.html").read_text()
    assert html.count('<div class="citation"') == len(keys), "every entry of references.bib is rendered"
    assert "Press" in html and "rotary position embedding" in html.lower()
