"""The HTML report's logit lens and attention for every generated token, with a token selector.

The page holds the first token's lens and attention as plain HTML (what it shows with JavaScript off) and every
token's figures as JSON in the page; its own inline script (no library, nothing fetched) draws the token the
selector names with the same markup. Each step's figures are worked out here once, in Python, from the trace's
records (LensStep, AttentionStep, tracer/trace/attention_focus.py), so the script only lays them out: the first
token drawn by the script equals the static one (tests/test_html_report.py checks in Chromium).

Attention weights travel as integers in 1/10,000ths (a 32-token run's weights: tens of kB, not the trace's size);
a cell's title says its weight to 0.01%.
"""

from __future__ import annotations

import json
from html import escape
from typing import Any

from llmtrace.cli import formatting as fmt
from llmtrace.cli.html_tables import LEVELS
from llmtrace.tracer.trace.attention_focus import focused_heads, sink_heads
from llmtrace.tracer.trace.journey_records import AttentionStep, LensStep
from llmtrace.tracer.trace.run_trace import Trace

SCALE = 10_000  # attention weights as integers in 1/SCALE


def journey_steps(trace: Trace) -> list[dict[str, Any]]:
    """Every step with a lens or attention record, in order: the selector's label and each view's figures."""
    lens = {s.step: s for s in trace.lens}
    attention = {a.step: a for a in trace.attention}
    pieces = {s.step: s.piece for s in trace.steps}
    steps = []
    for step in sorted(lens.keys() | attention.keys()):
        piece = pieces.get(step, lens[step].piece if step in lens else "")
        steps.append({"token": step + 1, "label": f"token {step + 1}: {fmt.piece(piece)}",
                      "lens": _lens(lens[step]) if step in lens else None,
                      "attention": _attention(attention[step]) if step in attention else None})
    return steps


def _lens(s: LensStep) -> dict[str, Any]:
    chosen = fmt.piece(s.piece)
    n_layers = len(s.layers) - 1
    if s.first_top_layer is None:
        headline = (f"{chosen} is never the top token before the sampler (it was drawn at rank "
                    f"{s.layers[-1].chosen_rank})")
    else:
        headline = (f"{chosen} first becomes the top token after layer {s.first_top_layer} of {n_layers} "
                    f"(layers 0-{n_layers - 1}); after the embedding it ranks {s.layers[0].chosen_rank:,}")
    rows = []
    for layer in s.layers:
        mark = " ◀ first top" if layer.layer is not None and layer.layer == s.first_top_layer else ""
        rows.append(["embed" if layer.layer is None else f"L{layer.layer}",
                     [[f"{fmt.piece(t.piece)} {100 * t.probability:.0f}%", int(t.token_id == s.token_id)]
                      for t in layer.top],
                     f"{layer.chosen_rank:,}", f"{100 * layer.chosen_probability:.1f}%{mark}",
                     int(layer.chosen_rank == 1)])
    return {"position": s.position, "chosen": chosen, "headline": headline, "rows": rows,
            "instrument": fmt.duration_ns(s.instrument_ns)}


def _attention(a: AttentionStep) -> dict[str, Any]:
    pieces = [fmt.piece(p) for p in a.pieces]
    focused = [f"L{h.layer} head {h.head}: {h.entropy_bits:.2f} bits, {100 * h.top_weights[0]:.0f}% on "
               f"{pieces[h.top_positions[0]]} (position {h.top_positions[0]})" for h in focused_heads(a)]
    return {"position": a.position, "pieces": pieces,
            "w": [[round(w * SCALE) for w in row] for row in a.mean_weights],
            "sinks": f"{len(sink_heads(a))} of {len(a.heads)}", "focused": focused,
            "instrument": fmt.duration_ns(a.instrument_ns)}


def percent(v: int) -> str:
    """A weight in 1/SCALE as the cell's title writes it: 1234 -> "12.34%" (the script writes the same)."""
    return f"{v // 100}.{v % 100:02d}%"


def lens_html(d: dict[str, Any] | None) -> str:
    """One step's lens; the script's `lens` writes the same markup."""
    if d is None:
        return "<p class=\"note\">no logit lens for this token</p>"
    rows = "".join(
        ("<tr class=\"top\">" if top else "<tr>") + f"<td class=\"l\">{escape(name)}</td>"
        + "".join(f"<td class=\"l{' chosen' if chosen else ''}\">{escape(text)}</td>" for text, chosen in tops)
        + f"<td>{escape(rank)}</td><td>{escape(p)}</td></tr>"
        for name, tops, rank, p, top in d["rows"])
    return (f"<p><b>{escape(d['headline'])}</b></p><table class=\"lens\"><tr><th class=\"l\">after</th>"
            f"<th class=\"l\">top 1</th><th class=\"l\">top 2</th><th class=\"l\">top 3</th>"
            f"<th>{escape(d['chosen'])} rank</th><th>p</th></tr>{rows}</table>"
            f"<p class=\"note\">the residual stream at position {d['position']} after each layer, through the final "
            f"RMSNorm and the LM head, as if the model stopped there (instrumentation: not in the stages' FLOPs or "
            f"time; {escape(d['instrument'])} for this step).</p>")


def attention_html(d: dict[str, Any] | None) -> str:
    """One step's attention heat map (a cell's title: its layer, key position and weight) and its heads; the
    script's `attention` writes the same markup."""
    if d is None:
        return "<p class=\"note\">no attention record for this token</p>"
    pieces = d["pieces"]
    head = "".join(f"<th class=\"col\"><span>{escape(p)}</span></th>" for p in pieces)
    body = "".join(
        f"<tr><th>L{layer}</th>" + "".join(
            f"<td class=\"m{min(LEVELS - 1, v * LEVELS // SCALE)}\" title=\"L{layer} → {escape(pieces[i])} "
            f"(position {i}): {percent(v)}\"></td>" for i, v in enumerate(row)) + "</tr>"
        for layer, row in enumerate(d["w"]))
    focused = "".join(f"<li>{escape(line)}</li>" for line in d["focused"])
    return (f"<p class=\"caption\">position {d['position']} attending over {len(pieces)} positions, each layer's "
            f"heads averaged (darkest 0%, brightest 100%; {escape(d['instrument'])} of instrumentation)</p>"
            f"<div class=\"heatwrap\"><table class=\"heat\"><tr><th>layer</th>{head}</tr>{body}</table></div>"
            f"<p>{escape(d['sinks'])} heads put most weight on position 0 (the first token: an attention sink); the "
            f"most focused of the others (lowest entropy):</p><ul class=\"heads\">{focused}</ul>")


def journey_data(steps: list[dict[str, Any]]) -> str:
    """The steps as a JSON script element (inert data; `<` written as \\u003c so no text in it ends the element)."""
    text = json.dumps(steps, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    return f"<script type=\"application/json\" id=\"journey-data\">{text}</script>"


def picker(steps: list[dict[str, Any]]) -> str:
    """The selector (hidden until the script runs: without it, the page shows the first token and says so)."""
    options = "".join(f"<option value=\"{i}\">{escape(s['label'])}</option>" for i, s in enumerate(steps))
    return (f"<div class=\"picker\" id=\"picker\" hidden><button type=\"button\" id=\"token-prev\">◀</button> "
            f"<label for=\"token\">logit lens and attention of</label> <select id=\"token\">{options}</select> "
            f"<button type=\"button\" id=\"token-next\">▶</button> <span class=\"note\">of {len(steps)} generated "
            "tokens (← → keys too)</span></div>"
            "<noscript><p class=\"note\">showing the first generated token; the others need JavaScript (the "
            "page's own inline script)</p></noscript>")


# The script: `lens` and `attention` write what lens_html and attention_html write, from the same figures.
SCRIPT = """
(function () {
  "use strict";
  var steps = JSON.parse(document.getElementById("journey-data").textContent);
  var select = document.getElementById("token");
  var lensView = document.getElementById("lens-view");
  var attentionView = document.getElementById("attention-view");
  var LEVELS = %(levels)d, SCALE = %(scale)d;
  function esc(s) {
    return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#x27;");
  }
  function percent(v) {
    var cents = v %% 100;
    return Math.floor(v / 100) + "." + (cents < 10 ? "0" : "") + cents + "%%";
  }
  function lens(d) {
    if (!d) return '<p class="note">no logit lens for this token</p>';
    var rows = d.rows.map(function (r) {
      return "<tr" + (r[4] ? ' class="top"' : "") + '><td class="l">' + esc(r[0]) + "</td>" +
        r[1].map(function (t) {
          return '<td class="l' + (t[1] ? " chosen" : "") + '">' + esc(t[0]) + "</td>";
        }).join("") + "<td>" + esc(r[2]) + "</td><td>" + esc(r[3]) + "</td></tr>";
    }).join("");
    return "<p><b>" + esc(d.headline) + '</b></p><table class="lens"><tr><th class="l">after</th>' +
      '<th class="l">top 1</th><th class="l">top 2</th><th class="l">top 3</th><th>' + esc(d.chosen) +
      " rank</th><th>p</th></tr>" + rows + '</table><p class="note">the residual stream at position ' +
      d.position + " after each layer, through the final RMSNorm and the LM head, as if the model stopped " +
      "there (instrumentation: not in the stages' FLOPs or time; " + esc(d.instrument) + " for this step).</p>";
  }
  function attention(d) {
    if (!d) return '<p class="note">no attention record for this token</p>';
    var head = d.pieces.map(function (p) {
      return '<th class="col"><span>' + esc(p) + "</span></th>";
    }).join("");
    var body = d.w.map(function (row, layer) {
      return "<tr><th>L" + layer + "</th>" + row.map(function (v, i) {
        return '<td class="m' + Math.min(LEVELS - 1, Math.floor(v * LEVELS / SCALE)) + '" title="L' + layer +
          " → " + esc(d.pieces[i]) + " (position " + i + "): " + percent(v) + '"></td>';
      }).join("") + "</tr>";
    }).join("");
    var focused = d.focused.map(function (line) { return "<li>" + esc(line) + "</li>"; }).join("");
    return '<p class="caption">position ' + d.position + " attending over " + d.pieces.length +
      " positions, each layer's heads averaged (darkest 0%%, brightest 100%%; " + esc(d.instrument) +
      ' of instrumentation)</p><div class="heatwrap"><table class="heat"><tr><th>layer</th>' + head +
      "</tr>" + body + "</table></div><p>" + esc(d.sinks) + " heads put most weight on position 0 (the " +
      "first token: an attention sink); the most focused of the others (lowest entropy):</p>" +
      '<ul class="heads">' + focused + "</ul>";
  }
  function show(i) {
    var s = steps[i];
    select.value = String(i);
    if (lensView) lensView.innerHTML = lens(s.lens);
    if (attentionView) attentionView.innerHTML = attention(s.attention);
  }
  function step(by) {
    var i = Math.min(steps.length - 1, Math.max(0, Number(select.value) + by));
    select.value = String(i);
    select.dispatchEvent(new Event("change"));
  }
  select.addEventListener("change", function () { show(Number(select.value)); });
  document.getElementById("token-prev").addEventListener("click", function () { step(-1); });
  document.getElementById("token-next").addEventListener("click", function () { step(1); });
  document.addEventListener("keydown", function (e) {
    if (e.target && e.target.tagName === "SELECT") return;
    if (e.key === "ArrowLeft") step(-1);
    if (e.key === "ArrowRight") step(1);
  });
  Array.prototype.forEach.call(document.querySelectorAll("[data-token]"), function (span) {
    span.addEventListener("click", function () {
      var n = Number(span.getAttribute("data-token"));
      for (var i = 0; i < steps.length; i++) if (steps[i].token === n) { select.value = String(i); }
      select.dispatchEvent(new Event("change"));
      document.getElementById("picker").scrollIntoView();
    });
  });
  // ?token=N (a link to one token; how the tests pick one): chosen through the selector, as a click would
  var asked = /[?&]token=(\\d+)/.exec(location.search), first = 0;
  if (asked) {
    for (var i = 0; i < steps.length; i++) if (steps[i].token === Number(asked[1])) first = i;
  }
  select.value = String(first);
  select.dispatchEvent(new Event("change"));
  document.getElementById("picker").hidden = false;
})();
""" % {"levels": LEVELS, "scale": SCALE}


def script() -> str:
    return f"<script>{SCRIPT}</script>"
