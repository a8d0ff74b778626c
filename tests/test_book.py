"""The book: notebooks paired and in sync, the Colab install cell, the built pages in a real browser."""

import html as html_text
import json
import io
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

from posenc_lab.lab.figures import interactive as explore

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.md"))
CHAPTERS = [p.stem for p in NOTEBOOKS]


def cells(path):
    nb = jupytext.read(path)
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


#: the ten-minute tour: a notebook page like the chapters (paired, executed, run alone), but no chapter of its own
TOUR = "00_tour"


def test_there_are_fourteen_chapters_and_a_tour_and_all_are_in_the_toc():
    assert len(NOTEBOOKS) == 15 and TOUR in CHAPTERS
    toc = (ROOT / "_toc.yml").read_text()
    for stem in CHAPTERS:
        assert f"notebooks/{stem}" in toc
    files = re.findall(r"file: (\S+)", toc)
    assert files[0] == f"notebooks/{TOUR}", "the tour is the book's second page, after the landing page"


def test_the_tour_is_short_with_at_most_five_figures_each_section_linking_its_chapter():
    """The tour: at most 1,500 words of prose, at most five figures (one of them explorable), and every section
    links to the chapter that works it out."""
    sys.path.insert(0, str(ROOT / "book"))
    import readability

    text = (ROOT / "notebooks" / f"{TOUR}.md").read_text()
    words = sum(readability.words(block) for block in readability.prose_blocks(text))
    assert words <= 1500, f"the tour has {words} words of prose"
    figures = text.count("plt.show()") + text.count("explore.show(")
    assert figures <= 5 and text.count("explore.show(") >= 1, f"{figures} figures"
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) >= 5
    for section in sections:
        assert re.search(r"\{doc\}`[^`]*<0[1-9]_|\{doc\}`[^`]*<1[0-3]_", section), \
            f"the tour's section {section.splitlines()[0]!r} links no chapter"


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
    errors = [o.get("ename") for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{md.name}: committed outputs hold errors {errors}"


def install_cell(md):
    return next(c.source for c in jupytext.read(md).cells if c.cell_type == "code")


def test_every_notebook_installs_from_the_repository_url_in_config():
    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    first = {install_cell(md) for md in NOTEBOOKS}
    assert len(first) == 1, "every chapter starts with the same setup cell"
    assert f'"{url}"' in first.pop()


class _Recorder:
    """Stands in for subprocess.Popen: records each command and prints nothing."""
    commands: list = []

    def __init__(self, command, **kwargs):
        self.commands.append(command)
        self.stdout, self.returncode = io.BytesIO(b"progress\n"), 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("absent, no_results, wanted", [
    ((), False, None),
    ((), True, ["./posenc-lab-source/packaging/results"]),
    (("seaborn",), False, ["./posenc-lab-source[lab,figures]"]),
    (("posenc_lab",), False, ["./posenc-lab-source[lab,figures]", "./posenc-lab-source/packaging/results"]),
])
def test_install_cell_clones_once_and_installs_only_what_is_missing(absent, no_results, wanted, monkeypatch,
                                                                     tmp_path, capsys):
    """The setup cell checks the package, its committed results and the plotting libraries; it clones the
    repository only when one is missing, once, and installs from that clone only what is missing."""
    import importlib.util
    import subprocess as sp

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in absent else real(name, *a))
    monkeypatch.setattr(sp, "Popen", _Recorder)
    monkeypatch.chdir(tmp_path)
    if no_results:  # a folder without the results' marker: the results are not found
        monkeypatch.setenv("POSENC_LAB_RESULTS", str(tmp_path))
    _Recorder.commands = []
    exec(install_cell(NOTEBOOKS[0]), {})
    clones = [c for c in _Recorder.commands if c[:2] == ("git", "clone")]
    installs = [c for c in _Recorder.commands if "pip" in c]
    assert len(clones) == len(installs) == (wanted is not None)
    if wanted:
        assert list(installs[0][installs[0].index("on") + 1:]) == wanted
        assert "Installing" in capsys.readouterr().out

def colab_like_venv(path: Path) -> Path:
    """A fresh virtual environment that has the third-party dependencies (torch and friends) but not posenc_lab, as
    on Colab: our environment's site-packages as a plain path entry (its editable install's .pth is not processed)."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    py = path / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = subprocess.run([sys.executable, "-c", "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "colab_preinstalled.pth").write_text(ours + "\n")
    # the venv's own old setuptools would shadow ours (torch asks for a newer one); Colab's is recent too
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], capture_output=True)
    return py


def colab_env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # no network: the install cell is pointed at this checkout instead of the repository URL, and pip may not
    # reach an index (the build uses the environment's setuptools instead of downloading one); a plain path, so
    # that git clones it locally with hard links (a file:// URL would pack 100 MB for every chapter)
    env.update(POSENC_LAB_SOURCE=str(clean_source(tmp_path / "source")), PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0",
               PIP_DISABLE_PIP_VERSION_CHECK="1", TQDM_DISABLE="1", HOME=str(tmp_path))
    env.pop("MPLBACKEND", None)  # the kernel's inline backend, as on Colab: figures are outputs nbval compares
    return env


def clean_source(dest: Path) -> Path:
    """The tracked files of this checkout, as the repository URL would give them: no stale ``build/`` folder (setuptools
    would install its older copies of the modules), no virtual environment, no runs."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode:  # not a git checkout: everything but what the build and the runs leave behind
        skip = shutil.ignore_patterns("build", ".venv", "runs", "_build", "*.egg-info", ".git", "__pycache__", "_mathjax")
        return Path(shutil.copytree(ROOT, dest, ignore=skip))
    for name in filter(None, listed.stdout.split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    # a repository, as the URL is: the setup cell clones it
    git = ["git", "-c", "user.name=ci", "-c", "user.email=ci@localhost", "-c", "init.defaultBranch=main"]
    for step in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "source"]):
        subprocess.run(git + step, cwd=dest, check=True, capture_output=True)
    return dest


@pytest.fixture(scope="module")
def colab(tmp_path_factory):
    """One Colab-like environment for the module's tests: its python, its environment variables, its folder. The
    chapters' shared setup cell has run in it once, so posenc_lab and its results are installed from the clone, as
    on Colab after a chapter's first cell; the install itself is tested on its own, from an environment without
    them."""
    root = tmp_path_factory.mktemp("colab")
    py, env = colab_like_venv(root / "venv"), colab_env(root)
    setup = subprocess.run([str(py), "-c", install_cell(NOTEBOOKS[0])], capture_output=True, text=True, cwd=root,
                           env=env, timeout=600)
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    return py, env, root


@pytest.mark.slow
def test_colab_like_environment_installs_the_package(colab):
    """A Python that has torch and friends but not posenc_lab, as on Colab: the first cell installs it."""
    py, env, root = colab
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "posenc-lab"], capture_output=True, env=env)
    probe = "import importlib.util; print(importlib.util.find_spec('posenc_lab') is None)"
    before = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=root, env=env)
    assert before.stdout.strip() == "True", "the simulated Colab already has posenc_lab"
    cell = install_cell(NOTEBOOKS[0])
    check = cell + ("\nimport posenc_lab\nfrom posenc_lab.lab import results\nprint('device', device, 'posenc_lab', "
                    "posenc_lab.__version__, posenc_lab.__file__, results.folder('cpu'))\n")
    result = subprocess.run([str(py), "-c", check], capture_output=True, text=True, cwd=root, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "device cpu posenc_lab 0.1.0" in result.stdout and str(root / "venv") in result.stdout
    assert "site-packages/posenc_lab_results/cpu" in result.stdout  # the committed results came with their package


@pytest.mark.slow
@pytest.mark.parametrize("md", NOTEBOOKS, ids=CHAPTERS)
def test_chapter_runs_alone_as_colab_opens_it(md, colab, tmp_path):
    """The chapter's .ipynb, copied alone into an empty folder, executed top to bottom by nbval in the Colab-like
    environment, where the shared first cell has installed posenc_lab and its results from the clone: the outputs
    nbval expects, and no file outside the notebook read. (Every chapter's first cell is the same, and
    `test_colab_like_environment_installs_the_package` runs it where nothing is installed.) This is the suite's nbval
    check of each chapter (`make test-notebooks` runs nbval in .venv; the built-book test renders these committed
    outputs without executing the chapters again)."""
    py, env, _ = colab
    alone = tmp_path / md.stem
    alone.mkdir()
    shutil.copy(md.with_suffix(".ipynb"), alone)
    result = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                             "--nbval", "--nbval-current-env", "--nbval-cell-timeout=900", md.with_suffix(".ipynb").name],
                            capture_output=True, text=True, cwd=alone, env=env, timeout=1800)
    missing = sorted(set(re.findall(r"(?:FileNotFoundError|No such file or directory)[^\n]*", result.stdout)))
    assert result.returncode == 0, f"{md.stem} does not run alone: " + ("; ".join(missing) or result.stdout[-3000:])


@pytest.mark.parametrize("md", NOTEBOOKS, ids=CHAPTERS)
def test_explorable_figures_draw_in_the_notebook_offline(md):
    """A chapter with plotly figures carries plotly.js once, in its first figure's output, and loads nothing from a
    CDN: the saved notebook, opened offline, draws every figure in it."""
    calls = md.read_text().count("explore.show(")
    if not calls:
        return
    outputs = [o.get("data", {}).get("text/html", "") for c in jupytext.read(md.with_suffix(".ipynb")).cells
               if c.cell_type == "code" for o in c.get("outputs", [])]
    outputs = ["".join(o) if isinstance(o, list) else o for o in outputs]
    figures = [o for o in outputs if 'class="posenc-explore"' in o]
    assert len(figures) == calls, f"{md.name}: {len(figures)} plotly outputs for {calls} figures"
    assert [explore.LIBRARY_MARK in o for o in figures] == [True] + [False] * (calls - 1), \
        f"{md.name}: plotly.js is not in the first figure's output alone (re-execute the chapter)"
    scripts = [o.replace(explore.library(), "") for o in figures]  # plotly.js itself names URLs it never loads here
    assert not [o for o in scripts if "cdn.plot.ly" in o or "<script src" in o], f"{md.name}: a figure loads a CDN"


class PageScan(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.math, self.text, self.colab = [], 0, [], []
        self.ids, self.links = set(), []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
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


def chromium() -> str:
    """The headless browser; a failure on CI (where .ci/run installs it), a skip elsewhere."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs it with apt-get)")
        pytest.skip("chromium not installed: apt-get install chromium")
    return browser


# The browser has no network: every host name fails to resolve and every request goes to a proxy that is not
# there. A page that loads anything from a CDN (MathJax, plotly.js) then shows it missing, as a reader offline
# would see it; the book must work from its own files.
NO_NETWORK = ["--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE localhost", "--proxy-server=127.0.0.1:9",
              "--proxy-bypass-list=<-loopback>"]


def dump_dom(browser: str, page: Path, profile: Path, *, window: str | None = None) -> str:
    """The DOM of ``page`` after its scripts ran (MathJax, plotly), from a fresh headless profile, offline."""
    size = [f"--window-size={window}"] if window else []
    return subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", *NO_NETWORK,
         f"--user-data-dir={profile}", *size, "--virtual-time-budget=15000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=180).stdout


def warm_execution_cache(build: Path) -> None:
    """Put every committed, executed chapter into the build's execution cache (`execute_notebooks: cache`), so that
    `jupyter-book build` renders the committed outputs instead of executing each chapter again. The cache matches a
    chapter by the hash of its code cells, read from its .md; the paired .ipynb has the same cells (checked above),
    and its outputs are the ones nbval reproduces in `test_chapter_runs_alone_as_colab_opens_it`."""
    from jupyter_cache import get_cache

    cache = get_cache(str(build / "_build" / ".jupyter_cache"))  # where myst-nb looks: beside _build/html
    for md in NOTEBOOKS:
        cache.cache_notebook_file(str(md.with_suffix(".ipynb")), check_validity=True)


@pytest.fixture(scope="module")
def built_book(tmp_path_factory):
    """The book built from the committed chapters' outputs (`make book` executes them itself), with -W and -n."""
    out = tmp_path_factory.mktemp("book")
    subprocess.run(["make", "-s", "mathjax"], cwd=ROOT, check=True)
    warm_execution_cache(out)
    jupyter_book = Path(sys.executable).parent / "jupyter-book"
    result = subprocess.run([str(jupyter_book), "build", str(ROOT), "--path-output", str(out), "-W", "-n", "--keep-going"],
                            capture_output=True, text=True, timeout=1500)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    executed = re.findall(r"Executing notebook[^\n]*", log)
    assert not executed, f"{len(executed)} chapter(s) missed the warmed cache and were executed again: {log[-3000:]}"
    return out / "_build" / "html"


# measured in the page after load: every code block, printed output and output table that is wider than its box
_OVERFLOW_PROBE = """<script>window.addEventListener("load", () => setTimeout(() => {
  const wide = [...document.querySelectorAll("article pre, article div.cell_output, article table")]
    .filter(e => e.scrollWidth > e.clientWidth + 1)
    .map(e => e.tagName + ": " + e.textContent.trim().slice(0, 70));
  document.body.setAttribute("data-overflow", JSON.stringify(wide));
}, 500));</script>"""


def dump_doms(browser: str, jobs: list[tuple[Path, Path, str | None]]) -> list[str]:
    """``dump_dom`` for each (page, profile, window), one browser a core at a time (at least two)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda job: dump_dom(browser, job[0], job[1], window=job[2]), jobs))


def explorable_drawn(dom: str) -> int:
    """How many of the DOM's explorable figures plotly drew: its ``<div>`` holds plotly's svg and the slider."""
    figures = re.split(r'<div id="[^"]*" class="posenc-explore', dom)[1:]
    return sum('class="main-svg"' in f and 'class="slider-container"' in f for f in figures)


@pytest.fixture(scope="module")
def chapter_doms(built_book):
    """Each chapter's DOM after its scripts ran, opened once at 1300 x 1800 with the width probe added (a copy of
    the page beside it, so that its relative links still resolve)."""
    browser = chromium()
    jobs = []
    for stem in CHAPTERS:
        page = built_book / "notebooks" / f"{stem}.html"
        assert page.exists(), f"{page} was not built"
        probe = page.with_name(f"{stem}-probe.html")
        probe.write_text(page.read_text().replace("</body>", _OVERFLOW_PROBE + "</body>"))
        jobs.append((probe, built_book.parent / f"chrome-{stem}", "1300,1800"))
    return dict(zip(CHAPTERS, dump_doms(browser, jobs)))


@pytest.mark.slow
def test_book_pages_in_a_real_browser(built_book, chapter_doms):
    for stem in CHAPTERS:
        page = built_book / "notebooks" / f"{stem}.html"
        dom = chapter_doms[stem]
        scan = PageScan()
        scan.feed(dom)
        text = " ".join(scan.text)
        source = (ROOT / "notebooks" / f"{stem}.md").read_text()
        if "$" in source:
            assert scan.math > 0, f"{stem}: its math was not typeset by MathJax"
        for raw in ("\\(", "\\[", "$$"):
            assert raw not in text, f"{stem}: raw TeX {raw!r} left on the page"
        # chapters show the package's own one-line errors on purpose ("PosencError: ..."); any other error is a bug
        shown = text.replace("PosencError:", "").replace("PositionOutOfRange:", "")
        for marker in ("Traceback", "Error:", "NameError", "ModuleNotFoundError"):
            assert marker not in shown, f"{stem}: {marker!r} on the page"
        figures = [src for src in scan.images if "_images/" in src]
        for src in figures:
            image = (page.parent / src).resolve()
            assert image.exists() and image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{stem}: figure {src} does not load"
        assert scan.colab and all(h.endswith(f"notebooks/{stem}.ipynb") for h in scan.colab), f"{stem}: Colab link {scan.colab}"
        if "plt.show()" in source:
            assert figures, f"{stem}: draws figures but none is on the page"
        explorable = source.count("explore.show(")  # plotly figures, drawn by the book's own plotly.js (offline)
        assert explore.LIBRARY_MARK not in page.read_text(), f"{stem}: the notebook's inline plotly.js is on the page"
        if explorable:
            assert dom.count('class="posenc-explore') == explorable, f"{stem}: an explorable figure is missing"
            assert explorable_drawn(dom) == explorable, f"{stem}: an explorable figure was not drawn offline"


@pytest.mark.slow
def test_notebook_plotly_outputs_draw_offline_in_a_browser(tmp_path):
    """A chapter's committed plotly outputs, alone on a page in the order a notebook front end shows them, drawn
    by a browser without network: the first one's plotly.js must draw them all (no book, no CDN)."""
    browser = chromium()
    jobs, expected = [], {}
    for md in NOTEBOOKS:
        outputs = [o.get("data", {}).get("text/html", "") for c in jupytext.read(md.with_suffix(".ipynb")).cells
                   if c.cell_type == "code" for o in c.get("outputs", [])]
        figures = ["".join(o) if isinstance(o, list) else o for o in outputs]
        figures = [o for o in figures if 'class="posenc-explore"' in o]
        if figures:
            page = tmp_path / f"{md.stem}.html"
            page.write_text('<!doctype html><html><head><meta charset="utf-8"></head><body>'
                            + "\n".join(f'<div class="output">{o}</div>' for o in figures) + "</body></html>")
            jobs.append((page, tmp_path / f"chrome-{md.stem}", None))
            expected[md.stem] = len(figures)
    assert expected, "no chapter has an explorable figure"
    for (stem, count), dom in zip(expected.items(), dump_doms(browser, jobs)):
        assert explorable_drawn(dom) == count, f"{stem}: its saved plotly outputs do not draw offline"


@pytest.mark.slow
def test_no_sideways_scrolling_at_1300_px(chapter_doms):
    """Opened at 1300 x 1800, no code block, printed output or table of a chapter scrolls sideways."""
    wide = {}
    for stem, dom in chapter_doms.items():
        found = re.search(r'data-overflow="([^"]*)"', dom)
        assert found, f"{stem}: the width probe did not run"
        items = json.loads(html_text.unescape(found.group(1)))
        if items:
            wide[stem] = items
    assert not wide, f"scrolls sideways at 1300 px: {wide}"


REFERENCE_PAGES = sorted((ROOT / "book" / "reference").glob("*.md"))


@pytest.mark.slow
def test_reference_pages_in_a_real_browser(built_book):
    """The package reference: one page per module, each public function and class of the module on it (an
    anchor named after it), its formulas typeset by MathJax, and the licences in the footer."""
    import importlib
    import inspect

    browser = chromium()
    assert len(REFERENCE_PAGES) > 10
    pages = [built_book / "book" / "reference" / f"{md.stem}.html" for md in REFERENCE_PAGES]
    missing = [page.name for page in pages if not page.exists()]
    assert not missing, f"not built: {missing}"
    doms = dump_doms(browser, [(page, built_book.parent / f"chrome-ref-{page.stem}", None) for page in pages])
    for md, dom in zip(REFERENCE_PAGES, doms):
        scan = PageScan()
        scan.feed(dom)
        text = " ".join(scan.text)
        source = md.read_text()
        if "$" in source:
            assert scan.math > 0, f"reference/{md.stem}: its math was not typeset by MathJax"
        for raw in ("\\(", "\\[", "$$"):
            assert raw not in text, f"reference/{md.stem}: raw TeX {raw!r} left on the page"
        assert "CC BY 4.0" in text and "MIT" in text, f"reference/{md.stem}: the licences are not in the footer"
        if md.stem == "index":
            continue
        # the page's module: its first automodule directive (a lab page is named after its module's last part)
        module = importlib.import_module(re.search(r"automodule::\s*(\S+)", source).group(1))
        public = [f"{module.__name__}.{name}" for name, obj in vars(module).items()
                  if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                  and obj.__module__ == module.__name__]
        assert public, md.stem
        missing = [name for name in public if name not in scan.ids]
        assert not missing, f"reference/{md.stem}: no entry for {missing}"


@pytest.mark.slow
def test_chapters_link_to_the_reference_entries_of_what_they_print(built_book):
    """A chapter that prints a function's source links to the function's entry in the package reference."""
    for stem in CHAPTERS:
        if "inspect.getsource(" not in (ROOT / "notebooks" / f"{stem}.md").read_text():
            continue
        scan = PageScan()
        scan.feed((built_book / "notebooks" / f"{stem}.html").read_text())
        entries = [href for href in scan.links if "book/reference/" in href and "#posenc_lab." in href]
        assert entries, f"{stem}: no link into the package reference"
        for href in entries:
            target, anchor = href.split("#")
            html = (built_book / "notebooks" / target).resolve()
            assert html.exists() and f'id="{anchor}"' in html.read_text(), f"{stem}: broken reference link {href}"


@pytest.mark.slow
def test_references_page_lists_every_cited_paper(built_book):
    bib = (ROOT / "book" / "references.bib").read_text()
    keys = set(re.findall(r"@\w+\{([^,]+),", bib))
    cited = set()
    for md in NOTEBOOKS:
        for keys_in_one in re.findall(r"\{cite\}`([^`]+)`", md.read_text()):  # {cite}`a,b` cites two
            cited |= {key.strip() for key in keys_in_one.split(",")}
    assert cited <= keys, f"cited but not in the bibliography: {cited - keys}"
    html = (built_book / "book" / "references.html").read_text()
    assert html.count('<div class="citation"') == len(keys), "every entry of references.bib is rendered"
    assert "Press" in html and "rotary position embedding" in html.lower()
    # the entries are labelled by author and year, as the chapters cite them, not "PSL22"
    labels = re.findall(r'<span class="label"><span class="fn-bracket">\[</span>(.*?)<span', html)
    assert len(labels) == len(keys), labels[:5]
    assert "Press et al. 2022" in labels and "Kingma and Ba 2015" in labels and "Source article n.d." in labels
    assert not [label for label in labels if re.fullmatch(r"[A-Za-z+]+\d\d", label)], labels


def test_every_bibliography_entry_is_cited():
    bib = (ROOT / "book" / "references.bib").read_text()
    keys = set(re.findall(r"@\w+\{([^,]+),", bib))
    cited = set()
    for page in [*NOTEBOOKS, *(ROOT / "book").glob("*.md"), *(ROOT / "book" / "reference").glob("*.md")]:
        for group in re.findall(r"\{cite(?::\w+)?\}`([^`]+)`", page.read_text()):
            cited |= {k.strip() for k in group.split(",")}
    assert keys <= cited, f"in references.bib but never cited: {sorted(keys - cited)}"


@pytest.mark.parametrize("md", NOTEBOOKS, ids=CHAPTERS)
def test_code_lines_fit_the_page(md):
    """Code cells wider than 100 characters scroll sideways in the rendered book."""
    long = [(i, line) for cell_type, source in cells(md) if cell_type == "code"
            for i, line in enumerate(source.splitlines()) if len(line) > 100]
    assert not long, f"{md.name}: code lines over 100 characters: {long[:3]}"


@pytest.mark.parametrize("md", NOTEBOOKS, ids=CHAPTERS)
def test_every_chapter_ends_with_exercises_and_executed_solutions(md):
    if md.stem == TOUR:
        return  # a tour, not a chapter
    text = md.read_text()
    exercises = re.findall(r"```\{exercise\}\n:label: (\S+)", text)
    assert 2 <= len(exercises) <= 4, f"{md.name}: {len(exercises)} exercises"
    for label in exercises:
        start = text.index(f"```{{solution-start}} {label}")
        end = text.index("```{solution-end}", start)
        assert "```{code-cell}" in text[start:end], f"{md.name}: the solution of {label} runs no code"


@pytest.mark.parametrize("md", NOTEBOOKS, ids=CHAPTERS)
def test_chapters_read_committed_results_only_through_the_package(md):
    """A relative path to ../results exists in a checkout but not beside a notebook opened alone (Colab)."""
    for cell_type, source in cells(md):
        if cell_type == "code":
            assert "../results" not in source and "results/" not in source.replace("results.", ""), md.name
