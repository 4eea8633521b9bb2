"""Outside text reaches the terminal shown, never obeyed (issue 27, item 9): a prompt, a model's general.name, token
pieces and error messages pass through one function, cli/console.py's `visible_controls`, which writes C0/C1
controls, format characters (bidi overrides and isolates, zero-width characters, U+FEFF, tags), the line and
paragraph separators and lone surrogates as escapes."""

from __future__ import annotations

import json
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.cli.console import visible_controls

runner = CliRunner()

# Each of the characters, and its escape as it is printed.
NAMED = {
    "\u202e": "\\u202e",  # RIGHT-TO-LEFT OVERRIDE: reorders the rest of the line
    "\u2066": "\\u2066", "\u2067": "\\u2067", "\u2068": "\\u2068", "\u2069": "\\u2069",  # bidi isolates
    "\u200b": "\\u200b",  # ZERO WIDTH SPACE
    "\u2028": "\\u2028",  # LINE SEPARATOR (Zl)
    "\u2029": "\\u2029",  # PARAGRAPH SEPARATOR (Zp)
    "\ufeff": "\\ufeff",  # ZERO WIDTH NO-BREAK SPACE (BOM)
    "\U000e0041": "\\U000e0041",  # TAG LATIN CAPITAL LETTER A: invisible
    "\x1b": "\\x1b", "\x9b": "\\x9b",  # C0 ESC and C1 CSI, escaped as before
    "\udc80": "\\udc80",  # a lone surrogate (an undecodable byte under surrogateescape): unencodable as UTF-8
}


@pytest.mark.parametrize("char, shown", NAMED.items())
def test_each_named_character_is_escaped(char: str, shown: str) -> None:
    assert visible_controls(f"a{char}b") == f"a{shown}b"


def test_printable_text_passes_unchanged() -> None:
    text = "今天天气真 ·⏎⇥ café \t\n 😀 مرحبا Ελληνικά \u0301"  # tab, newline, RTL letters, a combining accent stay
    assert visible_controls(text) == text


def test_every_code_point_of_the_escaped_categories_and_no_other() -> None:
    """Over all of Unicode (the running Python's unicodedata): exactly Cc but tab and newline, Cf, Zl, Zp and Cs are
    escaped; each to Python's spelling of its code point."""
    wrong = []
    for code in range(sys.maxunicode + 1):
        char = chr(code)
        escaped = unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp", "Cs") and char not in "\t\n"
        want = (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}") \
            if escaped else char
        if visible_controls(char) != want:
            wrong.append(hex(code))
    assert not wrong, wrong[:20]


def test_a_right_to_left_override_in_a_saved_trace_is_shown_not_obeyed(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """general.name, the prompt and a token piece of a saved trace, each with bidi and zero-width characters: `show`
    prints their escapes and none of the characters themselves."""
    path = tmp_path / "run.json"
    result = runner.invoke(app, ["run", "sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "2",
                                 "--no-roofline", "--json", str(path)])
    assert result.exit_code == 0, result.output
    doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    doc["config"]["name"] = "evil\u202eemanlaer"
    doc["settings"]["prompt"] = "The \u2066sky\u2069 is\u200b"
    doc["steps"][0]["piece"] = "\u2028\ufeff"
    path.write_text(json.dumps(doc), encoding="utf-8")
    shown = runner.invoke(app, ["show", str(path), "--detail", "ops"])
    assert shown.exit_code == 0, shown.output
    for char in "\u202e\u2066\u2069\u200b\u2028\ufeff":
        assert char not in shown.output
    assert "evil\\u202eemanlaer" in shown.output
    assert "The \\u2066sky\\u2069 is\\u200b" in shown.output
    assert "\\u2028\\ufeff" in shown.output


def test_a_prompt_with_a_right_to_left_override_is_shown_not_obeyed(tiny_llama_dir: Path) -> None:
    result = runner.invoke(app, ["run", "a\u202eb", "--model", str(tiny_llama_dir), "--max-new-tokens", "1",
                                 "--no-roofline"])
    assert result.exit_code == 0, result.output
    assert "\u202e" not in result.output and "a\\u202eb" in result.output


def test_an_error_message_with_format_characters_is_shown_not_obeyed(tmp_path: Path) -> None:
    config = {"architectures": ["Evil\u202eForCausalLM"], "model_type": "llama", "vocab_size": 100,
              "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 96, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["flops", "-m", str(tmp_path)])
    assert result.exit_code == 2 and "\u202e" not in result.stderr and "Evil\\u202eForCausalLM" in result.stderr


def test_a_usage_error_quoting_an_argument_is_shown_not_obeyed(capsys: pytest.CaptureFixture[str]) -> None:
    """click's own errors quote the argument (an unknown option: as given, not repr'd); main() prints them through
    the same escaping."""
    from llmtrace.cli.app import main

    with pytest.raises(SystemExit) as ended:
        main(["kvmem", "--\u202ex\x1b[2J"])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("\n") == 1
    assert "\u202e" not in err and "\x1b" not in err and "No such option: --\\u202ex\\x1b[2J" in err
