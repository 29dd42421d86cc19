"""The course site (``bash scripts/site.sh``): built from the chapters' shared executions, then
opened page by page in a real browser (Debian's headless Chromium, scripts/install-browser.sh).

The build executes nothing that ``tests/test_notebooks.py`` already executed at this commit: both
read the same cache (``scripts/chapter_cache.py``), and under pytest-xdist whichever asks first
executes a chapter while the other waits for it or takes another one.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from html import unescape
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse

import pytest
from bs4 import BeautifulSoup

from autograder import notebook as grader_nb
from scripts import site  # the repository root is on sys.path (pyproject: pythonpath)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "site" / "_build" / "html"
SHOTS = ROOT / "site" / "_build" / "screenshots"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
LAB_NAMES = sorted(p.name for p in (ROOT / "labs").iterdir() if p.is_dir())
CHAPTER_STEMS = sorted(p.stem for p in (ROOT / "chapters").glob("*.ipynb"))
# each one a page of the site: docs/<stem>.html; not the mutation report, whose mutants are
# lines of the labs' reference solutions (the site never shows one)
DOC_PAGES = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "mutation-report.md")
PAGE_TIMEOUT_S = 60

pytestmark = pytest.mark.slow




@pytest.fixture(scope="module")
def built() -> Path:
    """The site, built once for this module (from the cached chapter executions)."""
    lines: list[str] = []
    t0 = time.perf_counter()
    rc = site.build(OUT, log=lines.append)
    print("\n".join(lines), f"\nsite built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    assert rc == 0, "the site did not build:\n" + "\n".join(lines)
    return OUT


def _pages(out: Path) -> list[Path]:
    skip = ("_static", "_sources", "_images", "_downloads")
    return sorted(p for p in out.rglob("*.html") if p.relative_to(out).parts[0] not in skip)


# ---------------------------------------------------------------------------------------
# what the site holds
# ---------------------------------------------------------------------------------------
@pytest.mark.timeout(1500)  # the first build of a commit may execute the chapters itself
def test_every_chapter_lab_and_reference_page_is_built(built):
    pages = {p.relative_to(built).as_posix() for p in _pages(built)}
    want = {"index.html", "api.html"} | {f"docs/{p.stem}.html" for p in DOC_PAGES}
    want |= {f"chapters/{c}.html" for c in CHAPTER_STEMS} | {f"labs/{lab}/{lab}.html" for lab in LAB_NAMES}
    want |= {f"api/{m}.html" for m in site.api_modules()}
    assert not want - pages, f"pages missing from the site: {sorted(want - pages)}"

    for stem in CHAPTER_STEMS:  # executed: its outputs and a figure are on the page
        soup = BeautifulSoup((built / "chapters" / f"{stem}.html").read_text(), "html.parser")
        assert soup.select(".cell_output"), f"chapters/{stem}.html shows no cell output"
        assert soup.select(".cell_output img"), f"chapters/{stem}.html shows no figure"
    for page in ["index.html", *(f"chapters/{c}.html" for c in CHAPTER_STEMS),
                 *(f"labs/{lab}/{lab}.html" for lab in LAB_NAMES)]:
        html = (built / page).read_text()
        if page != "index.html":
            assert "colab.research.google.com/github/" in html, f"{page}: no link to Colab"
            assert re.search(r'href="[^"]*_downloads/[^"]+\.py"', html), \
                f"{page}: no link to its plain-text source"
    warnings = (built.parent / "sphinx-warnings.txt").read_text()
    missing = [w for w in warnings.splitlines() if "xref_missing" in w or "toctree" in w]
    assert not missing, "links Sphinx could not resolve (a page links to a file the site " \
        "does not have):\n" + "\n".join(missing)
    grading = (built / "docs" / "grading.html").read_text()
    assert "grade.sh" in grading and "grades.csv" in grading, "docs/grading.md"
    assert "Task" in (built / "docs" / "LABS.html").read_text(), "docs/LABS.md"
    api = BeautifulSoup((built / "api" / "minickpt.html").read_text(), "html.parser")
    assert api.select("dl.py.class dt[id='minickpt.CheckpointManager']"), \
        "the API reference documents minickpt.CheckpointManager from its docstring"


# What Markdown looks like when it was not rendered (a fence, a link, emphasis, a heading, a
# table row, a directive, a comment), in a page's text outside its code.
RAW_MARKDOWN = re.compile(r"```|\]\(|\*\*|^\s*#{1,6} |^\s*\|.*\|\s*$|\{(include|toctree)\}|<!--",
                          re.M)


def _title(md: Path) -> str:
    """A Markdown page's title as the site shows it: its first heading, code marks dropped."""
    first = next(line for line in md.read_text(encoding="utf-8").splitlines()
                 if line.startswith("# "))
    return first[2:].replace("`", "").strip()


@pytest.mark.timeout(1500)
def test_every_docs_page_is_rendered_with_its_title(built):
    """Each page under docs/ is a page of the site (site/docs/<stem>.md includes it), in the
    navigation, with its own title, its text rendered (no Markdown left raw), and, for the
    performance page, the benchmark table between its markers and the scaling figure."""
    assert DOC_PAGES, "no page under docs/"
    nav = BeautifulSoup((built / "index.html").read_text(), "html.parser")
    nav_links = {a["href"].split("#")[0] for a in nav.select("nav a[href], .bd-sidebar a[href]")}
    for md in DOC_PAGES:
        rel = f"docs/{md.stem}.html"
        assert (built / rel).is_file(), f"{md.relative_to(ROOT)} is not on the site " \
            f"(add site/docs/{md.name} and the page to site/index.md's toctree)"
        assert rel in nav_links, f"{rel} is not in the site's navigation"
        soup = BeautifulSoup((built / rel).read_text(), "html.parser")
        article = soup.select_one("article") or soup.body
        for tag in article.select("a.headerlink"):
            tag.decompose()
        h1 = article.find("h1")
        assert h1 is not None, f"{rel}: no title"
        assert " ".join(h1.get_text().split()) == _title(md), \
            f"{rel}: the title is {h1.get_text()!r}, {md.name} says {_title(md)!r}"
        shown = len(article.get_text())
        body = len(md.read_text(encoding="utf-8"))
        assert shown > body / 2, f"{rel}: most of {md.name} is missing"
        for tag in article.select("pre, code, .highlight, script, style"):
            tag.decompose()
        text = article.get_text("\n")
        raw = RAW_MARKDOWN.search(text)
        assert raw is None, f"{rel}: Markdown not rendered: ...{text[max(0, raw.start() - 60):raw.end() + 60]!r}"
    perf = BeautifulSoup((built / "docs" / "performance.html").read_text(), "html.parser")
    rows = [tr for table in perf.select("table") for tr in table.select("tr")
            if "minickpt" in table.get_text() and "Orbax" in table.get_text()]
    assert len(rows) >= 20, "docs/performance.md: the benchmark table is not on the page"
    assert perf.select("img[src*='scaling']"), "docs/performance.md: the scaling figure"


@pytest.mark.timeout(60)
def test_readme_links_only_to_pages_that_exist():
    """The README is a front door: every page it links to is in the repository (and, being
    under docs/, on the site)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert local, "the README links to no page"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"the README links to files that do not exist: {missing}"
    assert len(readme.splitlines()) <= 150, "the README is a front door: details go to docs/"


@functools.cache
def _released_lines() -> frozenset[str]:
    """Every line some released lab shows: what every student is given is no secret of
    another lab (the README's training loop, on the library page, has a line of lab 2's
    release that is also part of a task of lab 3)."""
    return frozenset(line.strip() for lab in LAB_NAMES
                     for c in grader_nb.load_lab(ROOT / "labs" / lab / f"{lab}.ipynb").cells
                     for line in c.source.split("\n"))


def _secrets(lab: str) -> set[str]:
    """Every solution line and every hidden-test line of a lab (as the grader splits them) that
    the released lab does not also show (nor any other released lab)."""
    source = grader_nb.load_lab(ROOT / "solutions" / lab / f"{lab}.ipynb")
    shown = {line.strip() for c in source.cells for line in c.visible.split("\n")
             if c.role != "solution"}
    # the released lab's own words (a contract may quote a line as prose: `raise X(` ...)
    released = grader_nb.load_lab(ROOT / "labs" / lab / f"{lab}.ipynb")
    prose = "\n".join(c.source for c in released.cells).replace("`", "")
    out: set[str] = set()
    for c in source.cells:
        if c.role == "solution":
            inside = False
            for line in c.source.split("\n"):
                if grader_nb.SOLUTION_BEGIN in line or grader_nb.SOLUTION_END in line:
                    inside = grader_nb.SOLUTION_BEGIN in line
                elif inside and len(line.strip()) >= 6 and line.strip() not in shown:
                    out.add(line.strip())
        elif c.role in ("test", "quiz"):
            _, hidden = grader_nb.split_hidden(c.source)
            out |= {s.strip() for s in hidden.split("\n") if len(s.strip()) >= 12
                    and not s.strip().startswith("#") and s.strip() not in shown}
    return {line for line in out if line not in prose and line not in _released_lines()}


def _text(html: str) -> str:
    """What a page shows as text (tags dropped, entities decoded: ``&quot;`` is ``"``)."""
    html = re.sub(r"<(script|style)\b.*?</\1>", "", html, flags=re.S | re.I)
    return unescape(re.sub(r"<[^>]+>", "", html))


def _owner(rel: str) -> str:
    """Which chapter or lab a built file belongs to (``""``: the site's own pages)."""
    name = Path(rel).name
    for stem in [*CHAPTER_STEMS, *LAB_NAMES]:
        if name.startswith(stem + ".") or f"/{stem}/" in f"/{rel}":
            return stem
    return ""


@pytest.mark.timeout(1500)
def test_no_page_or_download_shows_a_solution_or_a_hidden_test(built):
    """The labs are on the site as students receive them. Checked: each lab's page and its
    downloads, and every page that belongs to no chapter (the API reference shows docstrings,
    never the source, which holds the reference solutions). A chapter may show what a lab
    hides (it teaches it), and so may a later lab: the rule of tests/test_course.py."""
    texts: dict[str, str] = {}
    for p in built.rglob("*"):
        if p.is_file() and p.suffix in (".html", ".ipynb", ".py", ".txt", ".md"):
            rel, raw = p.relative_to(built).as_posix(), p.read_text(errors="replace")
            texts[rel] = _text(raw) if p.suffix == ".html" else raw
    assert any(_owner(rel) == LAB_NAMES[0] for rel in texts), "no lab page found to check"
    for lab in LAB_NAMES:
        secrets = _secrets(lab)
        assert secrets, f"{lab}: found no solution or hidden line to look for"
        # on the lab's own pages, as tests/test_course.py; elsewhere (the API reference, the
        # authors' guide) a short line (`continue`, `return out`) is just Python
        leaks = sorted({(rel, s) for rel, t in texts.items() if _owner(rel) in (lab, "")
                        for s in secrets if s in t and (_owner(rel) or len(s) >= 12)})
        assert not leaks, (f"the site shows solution or hidden-test lines of {lab} "
                           f"(file, line): {leaks[:5]}")


def test_a_chapter_that_fails_stops_the_build_naming_its_cell(monkeypatch, tmp_path):
    failed = site.chapter_cache.Execution(
        ROOT / "chapters" / "01_basics.ipynb", "k", None,
        "chapters/01_basics.ipynb: cell 7 (id abc, starting 'x = 1') failed:\nValueError",
        1.0, False, None)
    monkeypatch.setattr(site.chapter_cache, "execute_all", lambda *a, **k: [failed])
    lines: list[str] = []
    assert site.build(tmp_path / "html", log=lines.append) == 1
    assert "cell 7" in "\n".join(lines) and not (tmp_path / "html").exists()


# ---------------------------------------------------------------------------------------
# in a real browser
# ---------------------------------------------------------------------------------------
class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _serve(folder: Path) -> Iterator[str]:
    """``folder`` over HTTP on a free localhost port, for the duration of the block."""
    handler = functools.partial(_Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.timeout = 5
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@contextlib.contextmanager
def _browser() -> Iterator[object]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        msg = "no chromium/chromedriver: run  sudo bash scripts/install-browser.sh"
        if os.environ.get("CI"):
            pytest.fail(f"{msg} (CI must run the browser check)")
        pytest.skip(msg)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="site-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-dev-shm-usage", "--window-size=1280,900",
                 f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "SEVERE"})
    os.environ.setdefault("SE_AVOID_STATS", "true")
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=opts)
    try:
        driver.set_page_load_timeout(PAGE_TIMEOUT_S)
        driver.set_script_timeout(PAGE_TIMEOUT_S)
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


MATHJAX_DONE = """
const done = arguments[arguments.length - 1];
const ticks = arguments[0];  // of 100 ms: how long MathJax may take to start
const wait = (n) => {
  if (document.readyState !== 'complete') {
    if (n > 0) { setTimeout(() => wait(n - 1), 100); } else { done('page not loaded'); }
  } else if (!document.querySelector('script[src*="mathjax"]')) {
    done('no MathJax on the page');
  } else if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    MathJax.startup.promise.then(() => done('typeset'), (e) => done('error: ' + e));
  } else if (n > 0) { setTimeout(() => wait(n - 1), 100); } else { done('MathJax did not start'); }
};
wait(ticks);  // typesetting itself is bounded by the script timeout
"""

PAGE_FACTS = """
const imgs = Array.from(document.images);
const math = Array.from(document.querySelectorAll('.math'));
return {
  broken_images: imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src),
  images: imgs.length,
  math: math.length,
  unrendered_math: math.filter(m => !m.querySelector('mjx-container')).map(m => m.textContent.slice(0, 80)),
  math_errors: Array.from(document.querySelectorAll('mjx-merror')).map(m => m.textContent.slice(0, 80)),
  error_outputs: document.querySelectorAll('.cell_output .output.traceback, .cell_output .output.error').length,
  tracebacks: Array.from(document.querySelectorAll('.cell_output')).filter(
      o => o.textContent.includes('Traceback (most recent call last)')).length,
  links: Array.from(document.querySelectorAll('a[href]')).map(a => a.href),
};
"""


def _ids(html: str) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', html))


def _browse(out: Path, pages: list[Path], shoot: tuple[str, ...] = (),
            mathjax_start_s: float = 10.0) -> tuple[list[str], str]:
    """Open every page of ``out`` in headless Chromium, served from localhost. Returns the
    problems found (one sentence each) and a line of what was checked. ``shoot``: pages (paths
    relative to ``out``) to take a screenshot of, into ``SHOTS``; a chapter also at its first
    figure."""
    problems: list[str] = []
    checked_links, math_pages, images = 0, 0, 0
    ids_cache: dict[Path, set[str]] = {}
    t0 = time.perf_counter()
    with _serve(out) as base, _browser() as driver:
        for page in pages:
            rel = page.relative_to(out).as_posix()
            driver.get(urljoin(base, rel))
            state = driver.execute_async_script(MATHJAX_DONE, int(mathjax_start_s * 10))
            facts = driver.execute_script(PAGE_FACTS)
            if facts["math"] and state != "typeset":
                problems.append(f"{rel}: math on the page but MathJax did not run ({state})")
            for what in ("broken_images", "unrendered_math", "math_errors"):
                if facts[what]:
                    problems.append(f"{rel}: {what.replace('_', ' ')}: {facts[what][:3]}")
            if facts["error_outputs"] or facts["tracebacks"]:
                problems.append(f"{rel}: an error cell or a traceback in the outputs")
            math_pages += bool(facts["math"])
            images += facts["images"]
            for entry in driver.get_log("browser"):  # a file that did not load, a JS error
                message = entry.get("message", "")
                if re.search(r"Failed to load resource|net::ERR_|Uncaught", message):
                    problems.append(f"{rel}: browser console: {message[:200]}")
            for href in facts["links"]:
                if not href.startswith(base):
                    continue  # Colab, the repository: outside this site
                url, fragment = urldefrag(href)
                target = out / urlparse(url).path.removeprefix("/")
                if target.is_dir():
                    target = target / "index.html"
                checked_links += 1
                if not target.is_file():
                    problems.append(f"{rel}: broken link to {href.removeprefix(base)}")
                elif fragment and target.suffix == ".html":
                    if target not in ids_cache:
                        ids_cache[target] = _ids(target.read_text(errors="replace"))
                    if fragment not in ids_cache[target]:
                        problems.append(f"{rel}: link to a missing anchor "
                                        f"{href.removeprefix(base)}")
            if rel in shoot:
                SHOTS.mkdir(parents=True, exist_ok=True)
                name = Path(rel).stem
                assert driver.save_screenshot(str(SHOTS / f"{name}.png")), f"no shot of {rel}"
                if rel.startswith("chapters/"):  # and the chapter at its first figure
                    driver.execute_script("document.querySelector('.cell_output img')"
                                          ".scrollIntoView({block: 'center'});")
                    assert driver.save_screenshot(str(SHOTS / f"{name}-figure.png"))
    summary = (f"browser: {len(pages)} pages, {checked_links} internal links, {images} images, "
               f"math on {math_pages} pages, {time.perf_counter() - t0:.1f} s")
    return problems, summary


@pytest.mark.timeout(1500)
def test_every_page_in_headless_chromium(built):
    first = f"chapters/{CHAPTER_STEMS[0]}.html"
    problems, summary = _browse(built, _pages(built), shoot=("index.html", first))
    print(f"\n{summary}; screenshots in {SHOTS}", file=sys.stderr)
    assert not problems, "the site in a browser:\n" + "\n".join(problems[:40])
    math_pages = int(re.search(r"math on (\d+) pages", summary).group(1))
    assert math_pages >= len(CHAPTER_STEMS), "the chapters' math should be on the site"
    for name in ("index.png", f"{CHAPTER_STEMS[0]}.png", f"{CHAPTER_STEMS[0]}-figure.png"):
        assert (SHOTS / name).stat().st_size > 10_000, f"{name}: an empty screenshot?"


@pytest.mark.timeout(300)
def test_the_browser_check_finds_each_kind_of_problem(tmp_path):
    """Without building anything: a page with one of each problem the check looks for."""
    (tmp_path / "other.html").write_text('<html><body><p id="here">x</p></body></html>')
    (tmp_path / "index.html").write_text("""<html><head>
<script src="_static/mathjax/tex-chtml.js"></script></head><body>
<img src="missing.png" alt="a figure that is not there">
<a href="nowhere.html">gone</a> <a href="other.html#here">fine</a> <a href="other.html#nope">x</a>
<a href="https://colab.research.google.com/">outside: not followed</a>
<span class="math notranslate nohighlight">\\(x^2\\)</span>
<div class="cell_output docutils container"><div class="output traceback highlight-ipythontb">
<pre>Traceback (most recent call last): ValueError</pre></div></div>
</body></html>""")
    problems, _ = _browse(tmp_path, [tmp_path / "index.html"], mathjax_start_s=1)
    text = "\n".join(problems)
    for expected in ("broken images", "broken link to nowhere.html", "missing anchor other.html#nope",
                     "MathJax did not run", "unrendered math", "error cell or a traceback",
                     "Failed to load resource"):
        assert expected in text, f"the check missed {expected!r}; it found:\n{text}"
    assert "#here" not in text and "colab" not in text


FORMULAS = """
const math = Array.from(document.querySelectorAll('math'));
const sizes = math.map(m => { const r = m.getBoundingClientRect(); return [r.width, r.height]; });
return {count: math.length, sizes: sizes, text: document.body.innerText,
        scripts: document.querySelectorAll('script').length};
"""


def test_a_feedback_page_renders_its_formulas_with_no_network(tmp_path):
    """Issue 34: the feedback page of a lab whose text holds formulas shows them typeset (MathML,
    drawn by the browser itself), with no script and nothing fetched; no raw TeX is left."""
    from autograder import feedback

    lab = grader_nb.load_lab(ROOT / "solutions" / "lab06_production" / "lab06_production.ipynb")
    text = [c for c in lab.cells if c.kind == "markdown"]
    assert any("$" in c.source for c in text), "lab 6's text has no formula to render"
    cells = [{"kind": "markdown", "role": "text", "grade_id": "", "show": c.source,
              "outputs": []} for c in text]
    result = {"student": "ann", "lab": lab.name, "status": "graded", "reason": "", "notes": [],
              "scores": {}, "messages": {}, "points": {}, "group_of": {}, "groups": {},
              "total": 0.0, "max_score": 0.0}
    page = tmp_path / "feedback.html"
    page.write_text(feedback.feedback_html(result, cells, {}, set()), encoding="utf-8")
    with _browser() as driver:
        driver.get(page.as_uri())
        facts = driver.execute_script(FORMULAS)
        driver.save_screenshot(str(tmp_path / "feedback.png"))
    assert facts["scripts"] == 0, "the feedback page runs a script"
    assert facts["count"] >= 3, f"only {facts['count']} formulas typeset"
    flat = [s for s in facts["sizes"] if s[0] < 1 or s[1] < 1]
    assert not flat, f"{len(flat)} of {facts['count']} formulas drawn with no size"
    for raw in ("\\(", "\\frac", "\\sqrt", "$$"):
        assert raw not in facts["text"], f"raw TeX {raw!r} shown on the feedback page"
