"""Bad input that was called an internal error (exit 1), or accepted, now one line and exit 2 (issue 27, item 7):
general.alignment of the wrong type or value, tensors whose byte ranges overlap or whose declared type does not fit
the bytes written, an odd head_dim (llama and qwen2), a token list shorter than the vocabulary, a prompt that is not
UTF-8 (standard input or the command line), running out of memory, a chat template whose error spans lines, and an
impossible --prompt-len refused before anything is printed."""

from __future__ import annotations

import errno
import io
import mmap
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from typer.testing import CliRunner

from llmtrace.cli.app import app, main
from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.errors import ConfigError, FileFormatError

runner = CliRunner()
REPO = Path(__file__).resolve().parent.parent
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _one_line_exit_2(code: int, stderr: str, *needles: str) -> None:
    assert code == 2, stderr
    assert stderr.count("\n") == 1 and "internal error" not in stderr and "Traceback" not in stderr, stderr
    for needle in needles:
        assert needle in stderr, stderr


# ---- the GGUF header -----------------------------------------------------------------------------------------------

TENSORS = (("token_embd.weight", (8, 64)), ("output_norm.weight", (64,)), ("output.weight", (8, 64)))


def _write(path: Path, alignment: Any = None, add: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """Three F32 tensors laid out by gguf-py (32-byte alignment), with `general.alignment` written as given
    (int -> uint32 or int32 by sign, float, str, bool, list) or `add` writing whatever else."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if isinstance(alignment, bool):
        writer.add_bool("general.alignment", alignment)
    elif isinstance(alignment, int):
        (writer.add_uint64 if alignment >= 0 else writer.add_int64)("general.alignment", alignment)
    elif isinstance(alignment, float):
        writer.add_float64("general.alignment", alignment)
    elif isinstance(alignment, str):
        writer.add_key_value("general.alignment", alignment, gguf.GGUFValueType.STRING)  # add_string skips ""
    elif isinstance(alignment, list):
        writer.add_array("general.alignment", alignment)
    if add is not None:
        add(writer)
    rng = np.random.default_rng(0)
    for name, shape in TENSORS:
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _patch_descriptor(path: Path, name: str, ggml_type: int | None = None, offset: int | None = None) -> None:
    """Rewrite the ggml type or data offset of tensor `name`'s descriptor in place (after its name: u32 n_dims,
    n_dims u64 dims, u32 type, u64 offset)."""
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    n_dims = struct.unpack_from("<I", data, at)[0]
    at += 4 + 8 * n_dims
    if ggml_type is not None:
        struct.pack_into("<I", data, at, ggml_type)
    if offset is not None:
        struct.pack_into("<Q", data, at + 4, offset)
    path.write_bytes(bytes(data))


def test_the_unpatched_file_reads(tmp_path: Path) -> None:
    header = read_gguf_header(_write(tmp_path / "m.gguf"))
    assert [t.name for t in header.tensors] == [name for name, _ in TENSORS]
    assert [t.offset for t in header.tensors] == [0, 2048, 2304]  # gguf-py: one after another, each padded to 32


alignments = (st.integers(min_value=-2**40, max_value=2**40) | st.floats(allow_nan=True, allow_infinity=True)
              | st.text(max_size=6) | st.booleans() | st.lists(st.integers(0, 64), min_size=1, max_size=3))


@FUZZ
@given(value=alignments)
def test_general_alignment_is_a_positive_power_of_two_or_one_line(tmp_path: Path, value: Any) -> None:
    """Was: int() of it (a string or an array: ValueError/TypeError, exit 1; NaN: ValueError), and a negative or
    non-power-of-two value used as it was."""
    path = _write(tmp_path / "m.gguf", alignment=value)
    good = isinstance(value, int) and not isinstance(value, bool) and value > 0 and not value & (value - 1)
    try:
        header = read_gguf_header(path)
    except FileFormatError as exc:
        message = str(exc)
        assert "\n" not in message
        if not good:
            assert "general.alignment is" in message and "not a power of two" in message, message
        else:  # a power of two other than the 32 the file was laid out with: its offsets do not fit it
            assert value != 32 and "general.alignment" not in message, message
        return
    assert good, f"general.alignment {value!r} accepted"
    assert header.data_offset % value == 0


@pytest.mark.parametrize("value, shown", [
    (-32, "-32"), (48, "48"), (0, "0"), (float("nan"), "nan"), ("32", "'32'"), ([32], "an array"), (True, "True")])
def test_each_wrong_alignment_is_named(tmp_path: Path, value: Any, shown: str) -> None:
    with pytest.raises(FileFormatError, match=rf"general\.alignment is {shown}, not a power of two"):
        read_gguf_header(_write(tmp_path / "m.gguf", alignment=value))


def test_overlapping_tensors_are_refused_naming_both(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf")
    _patch_descriptor(path, "output_norm.weight", offset=1024)  # inside token_embd's 2048 bytes
    with pytest.raises(FileFormatError, match=r"tensors 'token_embd.weight' \(bytes 0-2048 of the data\) and "
                                              r"'output_norm.weight' \(from 1024\) overlap"):
        read_gguf_header(path)


def test_a_tensor_starting_off_the_alignment_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf")
    _patch_descriptor(path, "output.weight", offset=2304 + 4)
    with pytest.raises(FileFormatError, match=r"'output.weight' starts at data offset 2308, not a multiple of the "
                                              r"file's alignment 32"):
        read_gguf_header(path)


def test_a_norm_declared_q8_0_over_f32_bytes_is_refused_naming_it(tmp_path: Path) -> None:
    """64 F32 values written (256 bytes), the type flipped to Q8_0 (2 blocks, 68 bytes): the loader would read 68
    bytes of floats as blocks, garbage weights without a word."""
    path = _write(tmp_path / "m.gguf")
    _patch_descriptor(path, "output_norm.weight", ggml_type=int(gguf.GGMLQuantizationType.Q8_0))
    with pytest.raises(FileFormatError, match=r"tensor 'output_norm.weight' is declared Q8_0 \[64\] \(68 bytes\) "
                                              r"but 256 bytes lie before the next tensor; its type does not match"):
        read_gguf_header(path)


def test_a_flipped_norm_in_a_real_model_file_is_one_line_from_the_cli(tiny_quantized: Callable[..., Path],
                                                                      tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(tiny_quantized(gguf.GGMLQuantizationType.Q8_0).read_bytes())
    _patch_descriptor(path, "output_norm.weight", ggml_type=int(gguf.GGMLQuantizationType.Q8_0))
    result = runner.invoke(app, ["flops", "--model", str(path)])
    _one_line_exit_2(result.exit_code, result.stderr, "'output_norm.weight' is declared Q8_0", "does not match")


# ---- config: head_dim, the vocabulary ------------------------------------------------------------------------------

def _gguf_meta(arch: str, **changes: Any) -> dict[str, Any]:
    meta = {"general.architecture": arch, f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2,
            f"{arch}.embedding_length": 64, f"{arch}.block_count": 2, f"{arch}.feed_forward_length": 96,
            f"{arch}.vocab_size": 100, f"{arch}.context_length": 256}
    meta.update({f"{arch}.{k}" if not k.startswith("tokenizer") else k: v for k, v in changes.items()})
    return meta


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_odd_head_dim_is_one_line(arch: str) -> None:
    """Was: RuntimeError "shape '[21, 1, 15]' is invalid" in RoPE, exit 1, for dim 60 over 4 heads."""
    with pytest.raises(ConfigError, match="head_dim is 15, odd; RoPE turns a head's values in pairs"):
        ModelConfig.from_gguf_metadata(_gguf_meta(arch, embedding_length=60), "m", "m.gguf")
    with pytest.raises(ConfigError, match="head_dim is 17, odd"):
        ModelConfig.from_gguf_metadata(_gguf_meta(arch, **{"attention.key_length": 17}), "m", "m.gguf")


@pytest.mark.parametrize("model_type, arch", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
def test_an_odd_head_dim_folder_is_one_line_from_run(make_tiny_llama: Callable[..., Path], model_type: str,
                                                     arch: str, tmp_path: Path) -> None:
    import json
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(make_tiny_llama("default"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type=model_type, architectures=[arch], head_dim=15)
    (folder / "config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["run", "sky", "--model", str(folder), "--max-new-tokens", "1", "--no-roofline"])
    _one_line_exit_2(result.exit_code, result.stderr, "head_dim is 15, odd")


@pytest.mark.parametrize("listed", [1, 99])
def test_a_token_list_shorter_than_the_vocabulary_is_one_line(listed: int) -> None:
    """Was: a sampled id past the list, IndexError 'piece id is out of range' mid-run (exit 1)."""
    meta = _gguf_meta("llama", **{"tokenizer.ggml.tokens": ["a"] * listed})
    with pytest.raises(ConfigError, match=rf"token list \(tokenizer.ggml.tokens\) has {listed} entries but its "
                                          r"vocabulary is 100 \(llama.vocab_size\)"):
        ModelConfig.from_gguf_metadata(meta, "m", "m.gguf")
    assert ModelConfig.from_gguf_metadata(_gguf_meta("llama", **{"tokenizer.ggml.tokens": ["a"] * 100}), "m",
                                          "m.gguf").vocab_size == 100


def test_a_token_list_shorter_than_the_vocabulary_is_one_line_from_run(make_tiny_llama: Callable[..., Path],
                                                                       sp_model_bytes: bytes, tmp_path: Path) -> None:
    from tiny_gguf import sentencepiece_vocab, write_tiny_gguf

    from llmtrace.tracer.load.hf_loader import load_hf_state_dict

    folder = make_tiny_llama("default")
    config = ModelConfig.from_hf_json(folder)
    vocab = sentencepiece_vocab(sp_model_bytes)
    short = {**vocab, **{k: vocab[k][:300] for k in ("tokens", "scores", "types")}}
    path = write_tiny_gguf(tmp_path / "short.gguf", config, load_hf_state_dict(folder, config), vocab=short)
    result = runner.invoke(app, ["run", "sky", "--model", str(path), "--max-new-tokens", "1", "--no-roofline"])
    _one_line_exit_2(result.exit_code, result.stderr, "has 300 entries but its vocabulary is")


# ---- the prompt ----------------------------------------------------------------------------------------------------

def _cli(args: list[str], stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "llmtrace", *args], cwd=REPO, input=stdin, capture_output=True,
                          timeout=300, env={**os.environ, "LC_ALL": "C.UTF-8"})


def test_invalid_utf8_on_standard_input_is_one_line() -> None:
    """Was: stdin decoded with surrogateescape, so the UnicodeDecodeError branch never ran; the lone surrogate
    failed later (exit 1)."""
    done = _cli(["run", "-", "--dry-run"], stdin=b"The sky \xff is")
    _one_line_exit_2(done.returncode, done.stderr.decode(), "standard input is not UTF-8 text (byte 0xff at offset 8)")


def test_invalid_utf8_on_the_command_line_is_one_line() -> None:
    done = _cli(["run", b"ab\xfe cd".decode("utf-8", "surrogateescape"), "--dry-run"])
    _one_line_exit_2(done.returncode, done.stderr.decode(),
                     "the prompt argument is not UTF-8 text (byte 0xfe at character 2)")


def test_crlf_on_standard_input_still_reads_as_lines() -> None:
    """Decoding the bytes itself keeps what text mode did: CRLF and CR are newlines."""
    from llmtrace.cli import prompt_input

    class Stdin:
        buffer = io.BytesIO("今天\r\n天气\r".encode())

        def isatty(self) -> bool:
            return False

    saved = sys.stdin
    sys.stdin = Stdin()  # type: ignore[assignment]
    try:
        assert prompt_input._read_stdin() == "今天\n天气"
    finally:
        sys.stdin = saved


@FUZZ
@given(raw=st.binary(min_size=1, max_size=40))
def test_any_bytes_on_standard_input_are_a_prompt_or_one_line(raw: bytes) -> None:
    from llmtrace.cli import prompt_input
    from llmtrace.tracer.core.errors import BadArgumentError

    class Stdin:
        buffer = io.BytesIO(raw)

        def isatty(self) -> bool:
            return False

    saved = sys.stdin
    sys.stdin = Stdin()  # type: ignore[assignment]
    try:
        text = prompt_input._read_stdin()
    except BadArgumentError as exc:
        assert "\n" not in str(exc)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return
        assert not raw.decode("utf-8").replace("\r", "\n").rstrip("\n"), str(exc)  # only an empty prompt
        return
    finally:
        sys.stdin = saved
    assert text == raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n").rstrip("\n")
    text.encode("utf-8")  # no lone surrogate got through


# ---- running out of memory -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("error", [OSError(errno.ENOMEM, "Cannot allocate memory"), MemoryError()])
def test_running_out_of_memory_is_one_line(error: BaseException, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """mmap under `ulimit -v` raises OSError(ENOMEM), an allocation MemoryError: were 'internal error', exit 1. Raised
    here where a command reads the model's config, since where the files are mapped changes with the loaders."""
    path = _write(tmp_path / "m.gguf")

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(ModelConfig, "from_gguf_metadata", refused)
    with pytest.raises(SystemExit) as ended:
        main(["flops", "--model", str(path)])
    err = capsys.readouterr().err
    said = "[Errno 12] Cannot allocate memory" if isinstance(error, OSError) else "an allocation failed"
    _one_line_exit_2(ended.value.code, err, f"out of memory ({said})", "ulimit -v")


# ---- a chat template's error, --prompt-len ------------------------------------------------------------------------

def test_a_chat_template_error_over_four_lines_is_one_line(make_tiny_llama: Callable[..., Path],
                                                           sp_model_bytes: bytes, tmp_path: Path) -> None:
    from tiny_gguf import sentencepiece_vocab, write_tiny_gguf

    from llmtrace.tracer.load.hf_loader import load_hf_state_dict

    folder = make_tiny_llama("default")
    config = ModelConfig.from_hf_json(folder)
    template = "{{ raise_exception('first line\\nsecond line\\nthird line\\nfourth line') }}"
    path = write_tiny_gguf(tmp_path / "chat.gguf", config, load_hf_state_dict(folder, config),
                           vocab=sentencepiece_vocab(sp_model_bytes), chat_template=template)
    result = runner.invoke(app, ["run", "sky", "--model", str(path), "--chat", "--max-new-tokens", "1",
                                 "--no-roofline"])
    _one_line_exit_2(result.exit_code, result.stderr,
                     "the chat template failed to render (first line second line third line fourth line); "
                     "run without --chat")


def test_an_impossible_prompt_tokens_is_refused_before_anything_is_printed() -> None:
    """Was: the model's header line, then the refusal."""
    result = runner.invoke(app, ["run", "--dry-run", "--model", "llama2-7b", "--prompt-len", str(10**30)])
    _one_line_exit_2(result.exit_code, result.stderr, f"the prompt is {10**30} tokens but llama2-7b holds 4096")
    assert result.stdout == ""
