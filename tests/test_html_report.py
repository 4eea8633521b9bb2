"""The HTML report: one self-contained page (inline SVG and CSS, one inline script, nothing fetched) from `run --html`
and `show --html`, with contents that link every section, heat maps whose cells say the trace's values on hover,
and the logit lens and attention of every generated token behind a selector. In a real headless Chromium it loads
without a console message, its screenshot shows the figures, the selector switches tokens, and with JavaScript off
it shows the first token as the script draws it. (Its figures against the terminal's: tests/test_html_terminal.py.)"""

from __future__ import annotations

import html as htmllib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmtrace.cli import formatting as fmt
from llmtrace.cli import html_figures as figs
from llmtrace.cli.app import app
from llmtrace.cli.html_tables import LEVELS
from llmtrace.cli.render_html import _label, html_report
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.trace.records import DECODE, PREFILL, RunSettings
from llmtrace.tracer.trace.run_trace import Trace

# `make test` installs the html extra; a venv set up before it existed says so instead of failing every test here
pytest.importorskip("matplotlib", reason="the HTML report needs the html extra: pip install -e '.[html]' (make test "
                                         "installs it)")
runner = CliRunner()
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH: the page is not loaded in a real browser (`.ci/run` installs "
                             "Debian's chromium; apt-get install -y chromium)")
SECTIONS = ("tokens", "summary", "stages", "heat", "roofline", "decode", "sampling", "lens", "attention", "no-cache")
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def trace(tiny_llama_dir: Path) -> Trace:
    settings = RunSettings(model=str(tiny_llama_dir), prompt="The capital of France is", max_new_tokens=NEW_TOKENS,
                           lens=True, attention=True, no_kv_cache=True)
    return generate(load_model(str(tiny_llama_dir)), settings)


@pytest.fixture(scope="module")
def page(trace: Trace, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("html") / "report.html"
    path.write_text(html_report(trace), encoding="utf-8")
    return path


def _element(html: str, element_id: str) -> str:
    """The inner HTML of the <div> or <section> with this id (they do not nest in themselves on this page)."""
    match = re.search(rf'<(div|section) id="{element_id}"[^>]*>(.*?)</\1>', html, re.S)
    assert match, element_id
    return match.group(2)


def _titles(html: str) -> list[str]:
    return [htmllib.unescape(t) for t in re.findall(r'<td class="[vm]\d+" title="([^"]*)"', html)]


def test_one_self_contained_page_with_every_section(page: Path) -> None:
    html = page.read_text(encoding="utf-8")
    for anchor in SECTIONS:
        assert f'<section id="{anchor}">' in html
    # the roofline, decode times and no-cache ratios are SVG figures; the heat maps are tables (values on hover)
    assert html.count("<svg") == 3
    # nothing to fetch: no link, no external src/href/url (SVG namespace URIs are names, not fetches); the scripts
    # are the page's own: its data (inert JSON) and the selector, neither loaded from anywhere nor loading anything
    assert "<link" not in html
    assert re.findall(r"<script[^>]*>", html) == ['<script type="application/json" id="journey-data">', "<script>"]
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:|//)""", html)
    assert not re.search(r"url\(\s*['\"]?(https?:|//)", html)
    assert not re.search(r"fetch\(|XMLHttpRequest|import\(|WebSocket|\beval\(", html)
    assert "<text" not in html  # matplotlib's text drawn as paths: no font needed
    ids = re.findall(r'\sid="([^"]+)"', html)
    assert len(ids) == len(set(ids))  # every figure's ids scoped to it
    referenced = set(re.findall(r'(?:href="|url\()#([^")]+)', html))
    assert referenced and referenced <= set(ids)  # and every reference (glyphs, clip paths, contents) resolves


def test_contents_link_every_section_in_order(page: Path) -> None:
    html = page.read_text(encoding="utf-8")
    nav = re.search(r'<nav id="contents">(.*?)</nav>', html, re.S)
    assert nav
    links = re.findall(r'<a href="#([^"]+)">([^<]+)</a>', nav.group(1))
    assert [anchor for anchor, _ in links] == list(SECTIONS)
    for anchor, title in links:  # each link's words are its section's heading
        assert re.search(rf'<section id="{anchor}"><h2>{re.escape(title)}</h2>', html), anchor


def test_heat_map_cells_say_the_traces_times(trace: Trace, page: Path) -> None:
    """Each cell's title: its layer, its stage and that stage's own time there (decode: the mean per step), summed
    here from the stage records."""
    heat = _element(page.read_text(encoding="utf-8"), "heat")
    titles = _titles(heat)
    expected = []
    for phase in (PREFILL, DECODE):
        steps = sum(1 for s in trace.steps if s.phase == phase)
        sums: dict[tuple[int, str], float] = {}
        for s in trace.stages:
            if s.phase == phase and s.layer is not None:
                key = (s.layer, _label(s.short_name))
                sums[key] = sums.get(key, 0.0) + s.duration_ns / steps
        expected += [f"L{layer} · {label}: {fmt.duration_ns(ns)}" for (layer, label), ns in sums.items()]
    assert sorted(titles) == sorted(expected)
    assert len(titles) == 2 * trace.config.n_layers * len({s.short_name for s in trace.stages if s.layer is not None})


def test_attention_cells_say_the_first_tokens_weights(trace: Trace, page: Path) -> None:
    first = trace.attention[0]
    titles = _titles(_element(page.read_text(encoding="utf-8"), "attention-view"))
    assert len(titles) == len(first.mean_weights) * first.positions
    for title in titles:
        layer, piece, position, pct = re.fullmatch(r"L(\d+) → (.*) \(position (\d+)\): (\d+\.\d\d)%", title).groups()
        weight = first.mean_weights[int(layer)][int(position)]
        assert piece == fmt.piece(first.pieces[int(position)])
        assert abs(float(pct) - 100 * weight) <= 0.005 + 1e-9


def test_every_generated_token_is_in_the_selector_and_its_data(trace: Trace, page: Path) -> None:
    html = page.read_text(encoding="utf-8")
    options = re.findall(r'<option value="(\d+)">([^<]*)</option>', html)
    assert [(int(v), htmllib.unescape(label)) for v, label in options] == [
        (i, f"token {s.step + 1}: {fmt.piece(s.piece)}") for i, s in enumerate(trace.steps)]
    assert len(trace.steps) == NEW_TOKENS == len(trace.lens) == len(trace.attention)


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
        # the lens, no attention: the selector's lens only; the roofline and decode times are the SVG figures
        assert '<section id="lens">' in html and '<section id="attention">' not in html
        assert html.count("<svg") == 2 and html.count("<option ") == 3
    # a saved trace is not judged against this machine: the page says so, as `show` does
    assert "roofline: left out of a saved trace" in shown.read_text(encoding="utf-8")
    bad = runner.invoke(app, ["show", str(saved), "--html", str(tmp_path / "missing" / "r.html")])
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1


# ---- in a real browser ------------------------------------------------------------------------------------------


def _chromium(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--host-resolver-rules=MAP * ~NOTFOUND", *args], capture_output=True, text=True,
                          timeout=180)


def _dom(uri: str) -> str:
    """The page's DOM after it loaded and its script ran."""
    proc = _chromium("--dump-dom", uri)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@needs_browser
def test_chromium_loads_it_without_console_messages_and_shows_the_figures(page: Path, tmp_path: Path) -> None:
    from PIL import Image  # matplotlib's own dependency

    shot = tmp_path / "shot.png"
    proc = _chromium("--enable-logging=stderr", "--v=0", "--window-size=1200,6000", f"--screenshot={shot}",
                     page.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line or "net::ERR" in line]
    assert console == []  # no script error, no failed load
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 6000)
    pixels = {colour: n for n, colour in image.getcolors(maxcolors=1 << 20)}  # type: ignore[union-attr]
    # every colour a heat-map cell takes (viridis: times, magma: attention weights) fills at least a cell's area
    html = page.read_text(encoding="utf-8")
    palette = {f"{cls}{i}": colour for cls, name in (("v", "viridis"), ("m", "magma"))
               for i, colour in enumerate(figs.palette(name, LEVELS))}
    used = set(re.findall(r'<td class="([vm]\d+)"', html))
    assert len(used) > 5
    for cls in used:
        rgb = tuple(int(palette[cls][i:i + 2], 16) for i in (1, 3, 5))
        assert pixels.get(rgb, 0) >= 12 * 10, cls
    # and the figures' markers and lines: matplotlib's first two colours (prefill, decode)
    assert pixels.get((255, 127, 14), 0) > 100 and pixels.get((31, 119, 180), 0) > 100
    dom = _dom(page.as_uri())
    assert all(f'<section id="{anchor}">' in dom for anchor in SECTIONS)
    assert '<div class="picker" id="picker">' in dom  # the script showed the selector


@needs_browser
def test_the_selector_switches_tokens_and_the_script_draws_what_the_page_holds(trace: Trace, page: Path) -> None:
    # JavaScript off, as a browser without it sees the page (headless Chromium's --dump-dom needs script itself)
    html = page.read_text(encoding="utf-8")
    without = page.with_name("without-script.html")
    without.write_text(re.sub(r"<script.*?</script>", "", html, flags=re.S), encoding="utf-8")
    static = _dom(without.as_uri())
    assert 'id="picker" hidden' in static  # no selector that would do nothing; the first token is shown
    assert f"<th>{fmt.piece(trace.lens[0].piece)} rank</th>" in htmllib.unescape(_element(static, "lens-view"))
    drawn = _dom(page.as_uri())  # the script draws the first token again, from the page's data
    assert 'id="picker" hidden' not in drawn
    for view in ("lens-view", "attention-view"):
        assert _element(drawn, view) == _element(static, view)
    # ?token=N picks token N through the selector's change event, as choosing it does
    chosen = trace.steps[2]
    dom = _dom(page.as_uri() + f"?token={chosen.step + 1}")
    lens, attention = trace.lens[2], trace.attention[2]
    assert lens.step == attention.step == chosen.step
    shown = _element(dom, "lens-view")
    assert f"the residual stream at position {lens.position} after each layer" in shown
    assert f"<th>{fmt.piece(lens.piece)} rank</th>" in htmllib.unescape(shown)
    ranks = re.findall(r"<tr(?: class=\"top\")?><td class=\"l\">(embed|L\d+)</td>(?:<td[^>]*>[^<]*</td>){3}"
                       r"<td>([\d,]+)</td><td>([\d.]+)%", shown)  # a piece's < and > are escaped here
    assert [(name, int(rank.replace(",", "")), p) for name, rank, p in ranks] == [
        ("embed" if x.layer is None else f"L{x.layer}", x.chosen_rank, f"{100 * x.chosen_probability:.1f}")
        for x in lens.layers]
    titles = _titles(_element(dom, "attention-view"))
    prompt = trace.prefill_step.input_tokens  # type: ignore[union-attr]
    assert len(titles) == trace.config.n_layers * attention.positions == trace.config.n_layers * (prompt + 2)
    for title in titles:
        layer, position, pct = re.fullmatch(r"L(\d+) → .* \(position (\d+)\): (\d+\.\d\d)%", title).groups()
        assert abs(float(pct) - 100 * attention.mean_weights[int(layer)][int(position)]) <= 0.005 + 1e-9
    assert titles != _titles(_element(static, "attention-view"))
