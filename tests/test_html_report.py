"""The HTML report: one self-contained page (inline SVG, nothing fetched) from `run --html` and `show --html`, and
in a real headless Chromium it loads without a console message and its screenshot shows the figures."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.cli.render_html import html_report
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.trace.records import RunSettings
from llmtrace.tracer.trace.run_trace import Trace

# `make test` installs the html extra; a venv set up before it existed says so instead of failing every test here
pytest.importorskip("matplotlib", reason="the HTML report needs the html extra: pip install -e '.[html]' (make test "
                                         "installs it)")
runner = CliRunner()
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH: the page is not loaded in a real browser (`.ci/run` installs "
                             "Debian's chromium; apt-get install -y chromium)")
SECTIONS = ("tokens", "summary", "heat", "roofline", "decode", "attention", "lens", "sampling", "no-cache")


@pytest.fixture(scope="module")
def trace(tiny_llama_dir: Path) -> Trace:
    settings = RunSettings(model=str(tiny_llama_dir), prompt="The capital of France is", max_new_tokens=4,
                           lens=True, attention=True, no_kv_cache=True)
    return generate(load_model(str(tiny_llama_dir)), settings)


@pytest.fixture(scope="module")
def page(trace: Trace, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("html") / "report.html"
    path.write_text(html_report(trace), encoding="utf-8")
    return path


def test_one_self_contained_page_with_every_section(page: Path) -> None:
    html = page.read_text(encoding="utf-8")
    for anchor in SECTIONS:
        assert f'<section id="{anchor}">' in html
    # heat maps (prefill, decode), roofline, decode times, attention strip, no-cache ratios: inline SVG figures
    assert html.count("<svg") == 6
    # nothing to fetch: no script, no link, no external src/href/url (SVG namespace URIs are names, not fetches)
    assert "<script" not in html and "<link" not in html
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:|//)""", html)
    assert not re.search(r"url\(\s*['\"]?(https?:|//)", html)
    assert "<text" not in html  # matplotlib's text drawn as paths: no font needed
    ids = re.findall(r'\sid="([^"]+)"', html)
    assert len(ids) == len(set(ids))  # every figure's ids scoped to it
    referenced = set(re.findall(r'(?:href="|url\()#([^")]+)', html))
    assert referenced and referenced <= set(ids)  # and every reference (glyphs, clip paths) resolves


def test_run_and_show_write_it(tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    live, saved, shown = tmp_path / "run.html", tmp_path / "t.json", tmp_path / "show.html"
    result = runner.invoke(app, ["run", "sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "3", "--lens",
                                 "--no-roofline", "--html", str(live), "--json", str(saved)])
    assert result.exit_code == 0, result.output
    assert f"HTML report written to {live}" in result.output
    result = runner.invoke(app, ["show", str(saved), "--html", str(shown)])
    assert result.exit_code == 0, result.output
    for path in (live, shown):
        html = path.read_text(encoding="utf-8")
        assert '<section id="lens">' in html and html.count("<svg") == 4  # 2 heat maps, roofline, decode times
    bad = runner.invoke(app, ["show", str(saved), "--html", str(tmp_path / "missing" / "r.html")])
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1


@needs_browser
def test_chromium_loads_it_without_console_messages_and_shows_the_figures(page: Path, tmp_path: Path) -> None:
    from PIL import Image  # matplotlib's own dependency

    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
         "--v=0", "--host-resolver-rules=MAP * ~NOTFOUND", "--window-size=1200,4000", f"--screenshot={shot}",
         page.as_uri()], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line or "net::ERR" in line]
    assert console == []  # no script error, no failed load
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 4000)
    # the figures' colour maps (viridis, magma) and markers: saturated pixels, which text and tables never are
    saturation = image.convert("HSV").getchannel("S").histogram()  # 256 bins
    coloured = sum(saturation[100:])
    assert coloured > 0.05 * image.size[0] * image.size[1]
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=180)
    assert all(f'<section id="{anchor}">' in dom.stdout for anchor in SECTIONS)
