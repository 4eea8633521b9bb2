"""Where `run`'s prompt comes from: the argument, a sample prompt named by it, --file, or standard input ('-').

Sample prompts are package data (llmtrace.sample_prompts), read with importlib.resources, so an installed wheel has
them as a checkout does. A sample name is a convenience that must never hide what was traced: the resolved prompt
says where it came from, and `--literal` traces the argument itself even when it equals a sample name.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from llmtrace.tracer.core.errors import BadArgumentError

SAMPLE_PACKAGE = "llmtrace.sample_prompts"
STDIN = "-"


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    source: str  # "" for a prompt given as the argument; else where it was read ("sample prompt 'sky'", "stdin")


def sample_prompt_names() -> list[str]:
    """The names `run` accepts for a sample prompt (the .txt files of llmtrace.sample_prompts), sorted."""
    return sorted(entry.name.removesuffix(".txt") for entry in resources.files(SAMPLE_PACKAGE).iterdir()
                  if entry.name.endswith(".txt"))


def sample_prompt(name: str) -> str | None:
    """The text of sample prompt `name` ('sky' or 'sky.txt'), or None when there is no such sample."""
    stem = name.removesuffix(".txt")
    if not stem or "/" in stem or "\\" in stem or stem.startswith("."):
        return None
    entry = resources.files(SAMPLE_PACKAGE).joinpath(f"{stem}.txt")
    return entry.read_text(encoding="utf-8").rstrip("\n") if entry.is_file() else None


def resolve_prompt(argument: str | None, file: Path | None, literal: bool, default: str | None) -> Prompt:
    """The prompt to trace. `default` serves when nothing was given (a dry run); otherwise a one-line error."""
    if file is not None:
        if argument is not None:
            raise BadArgumentError("give the prompt either as an argument or with --file, not both")
        if str(file) == STDIN:
            return Prompt(_read_stdin(), "stdin")
        try:
            return Prompt(file.read_text(encoding="utf-8").rstrip("\n"), f"file {file}")
        except (OSError, UnicodeDecodeError) as exc:
            raise BadArgumentError(f"cannot read prompt file {file} ({exc}); check the path") from exc
    if argument is None:
        if default is not None:
            return Prompt(default, "")
        names = ", ".join(sample_prompt_names())
        raise BadArgumentError(f"no prompt; give one, e.g. llmtrace run \"今天天气真\", '-' to read standard input, "
                               f"--file, or a sample name ({names})")
    _check_utf8(argument, "the prompt argument")
    if literal:
        return Prompt(argument, "")
    if argument == STDIN:
        return Prompt(_read_stdin(), "stdin")
    sample = sample_prompt(argument)
    if sample is not None:
        stem = argument.removesuffix(".txt")
        return Prompt(sample, f"sample prompt '{stem}' (pass --literal to trace the word itself)")
    return Prompt(argument, "")


def _check_utf8(text: str, what: str) -> None:
    """BadArgumentError when `text` holds bytes that were not UTF-8: Python decodes the command line (and a text
    stream) with surrogateescape, each such byte a lone surrogate U+DC80-DCFF."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        byte = ord(text[exc.start]) - 0xDC00 if 0xDC80 <= ord(text[exc.start]) <= 0xDCFF else None
        shown = f"byte 0x{byte:02x}" if byte is not None else f"U+{ord(text[exc.start]):04X}"
        raise BadArgumentError(f"{what} is not UTF-8 text ({shown} at character {exc.start}); give UTF-8 text "
                               "(check the terminal's locale: LANG=C.UTF-8)") from None


def _read_stdin() -> str:
    if sys.stdin is None or sys.stdin.isatty():
        raise BadArgumentError("'-' reads the prompt from standard input, but nothing is piped in; "
                               "e.g. echo \"The sky is\" | llmtrace run -")
    # The bytes, decoded here: Python's stdin decodes with the locale's encoding and surrogateescape, so an invalid
    # byte would arrive as a lone surrogate (U+DC80-DCFF) and fail later, unencodable, far from its cause.
    stream = getattr(sys.stdin, "buffer", None)
    if stream is not None:
        raw = stream.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadArgumentError(f"standard input is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
                                   f"{exc.start}); convert it, e.g. iconv -f latin1 -t utf-8") from None
        text = text.replace("\r\n", "\n").replace("\r", "\n")  # as text mode's universal newlines did
    else:
        text = sys.stdin.read()
        _check_utf8(text, "standard input")
    text = text.rstrip("\n")
    if not text:
        raise BadArgumentError("standard input was empty; pipe the prompt in, e.g. echo \"The sky is\" | llmtrace run -")
    return text
