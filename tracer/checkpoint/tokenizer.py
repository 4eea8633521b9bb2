"""Tokenizers: SentencePiece (`tokenizer.model`, LLaMA 1/2 style) and HF `tokenizers` (`tokenizer.json`, or a
`tokenizers.Tokenizer` built in memory from a GGUF vocabulary), behind one interface.

`piece(id)` is a token's display form: the text it contributes, with real spaces, and bytes that are not (yet)
whole UTF-8 characters written <0xE4>. `apply_chat_template` renders the model's Jinja chat template the way HF
transformers does (sandboxed, trim_blocks, lstrip_blocks, raise_exception, tojson).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from llmtrace.tracer.core.errors import CheckpointError, ConfigError, FileFormatError
from llmtrace.tracer.core.json_input import parse_json


def display_bytes(raw: bytes) -> str:
    """UTF-8 text where the bytes form whole characters, <0xNN> for each byte that does not."""
    out: list[str] = []
    while raw:
        try:
            out.append(raw.decode("utf-8"))
            break
        except UnicodeDecodeError as exc:
            out.append(raw[: exc.start].decode("utf-8"))
            out.extend(f"<0x{b:02X}>" for b in raw[exc.start : exc.end])
            raw = raw[exc.end :]
    return "".join(out)


class Tokenizer(ABC):
    """Text <-> token ids for one model. `add_bos` is the model's own default for `encode`."""

    bos_id: int | None
    eos_id: int | None
    chat_template: str | None
    add_bos: bool

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def _encode_plain(self, text: str) -> list[int]:
        """Ids of `text` without BOS/EOS (special-token strings in the text become their ids)."""

    @abstractmethod
    def _decode(self, ids: list[int]) -> str:
        """The text of ids that are all in the vocabulary."""

    @abstractmethod
    def _piece(self, token_id: int) -> str:
        """The display piece of an id in the vocabulary."""

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`. An id past the vocabulary (a model whose embedding has padding rows the tokenizer does
        not name, common in HF folders: a random or badly tuned model can draw one) reads as its `piece`."""
        ids, size = list(ids), self.vocab_size
        if all(0 <= i < size for i in ids):
            return self._decode(ids)
        out: list[str] = []
        start = 0
        for index, token_id in enumerate(ids):
            if not 0 <= token_id < size:
                out += [self._decode(ids[start:index]) if index > start else "", self.piece(token_id)]
                start = index + 1
        return "".join(out) + (self._decode(ids[start:]) if start < len(ids) else "")

    def piece(self, token_id: int) -> str:
        """What a table shows for one token; `<unnamed N>` for an id past the vocabulary."""
        return self._piece(token_id) if 0 <= token_id < self.vocab_size else f"<unnamed {token_id}>"

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; BOS first when `add_bos` (None: the model's default)."""
        ids = self._encode_plain(text)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            return [self.bos_id, *ids]
        return ids

    def token_text(self, token_id: int | None) -> str:
        """The raw vocabulary string of a special token (e.g. '<s>'), '' when the id is None."""
        return "" if token_id is None else self._raw_piece(token_id)

    @abstractmethod
    def _raw_piece(self, token_id: int) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text the chat template makes of `messages` ([{'role': 'user', 'content': '...'}, ...])."""
        if not self.chat_template:
            raise ConfigError("this model's tokenizer has no chat template; pass the prompt as plain text instead")
        template = _compile_template(self.chat_template)
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.token_text(self.bos_id),
                eos_token=self.token_text(self.eos_id),
                **extra,
            )
        except Exception as exc:  # jinja2 raises TemplateError, TypeError, UndefinedError... from template code
            why = " ".join(str(exc).split()) or type(exc).__name__  # Jinja's messages run over several lines
            raise ConfigError(f"the chat template failed to render ({why}); run without --chat") from exc


@lru_cache(maxsize=8)
def _compile_template(source: str) -> Any:
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise ConfigError("chat templates need jinja2: pip install jinja2, or pass the prompt as plain text") from exc

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        why = " ".join(str(exc).split())
        raise ConfigError(f"the chat template is not valid Jinja ({why}); run without --chat") from exc


# ---- SentencePiece -----------------------------------------------------------------------------------------------


class SentencePieceTokenizer(Tokenizer):
    """A `sentencepiece` model (LLaMA 1/2's tokenizer.model). Control-token strings in the text (<s>, </s>) become
    their ids, and text after one gets no dummy-prefix space, as HF's LlamaTokenizer (legacy=False) does."""

    def __init__(
        self,
        processor: Any,
        bos_id: int | None = None,
        eos_id: int | None = None,
        chat_template: str | None = None,
        add_bos: bool = True,
    ) -> None:
        self.sp = processor
        self.bos_id = bos_id if bos_id is not None else _none_if_negative(processor.bos_id())
        self.eos_id = eos_id if eos_id is not None else _none_if_negative(processor.eos_id())
        self.chat_template = chat_template
        self.add_bos = add_bos
        specials = [
            processor.id_to_piece(i)
            for i in range(processor.get_piece_size())
            if processor.is_control(i) or processor.is_unknown(i)
        ]
        self._special_ids = {p: processor.piece_to_id(p) for p in specials if p}
        pattern = "|".join(re.escape(p) for p in sorted(self._special_ids, key=len, reverse=True))
        self._special_re = re.compile(f"({pattern})") if pattern else None
        unk = processor.unk_id()
        self._unk_piece = processor.id_to_piece(unk) if unk >= 0 else None

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> "SentencePieceTokenizer":
        return cls.from_model_proto(_read_bytes(path), source=str(path), **kwargs)

    @classmethod
    def from_model_proto(cls, proto: bytes, source: str = "tokenizer.model", **kwargs: Any) -> "SentencePieceTokenizer":
        import sentencepiece as spm

        processor = spm.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(proto)
        except (RuntimeError, OSError) as exc:
            raise FileFormatError(f"{source}: not a valid SentencePiece model ({exc})") from exc
        return cls(processor, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def _encode_plain(self, text: str) -> list[int]:
        if self._special_re is None:
            return self.sp.encode(text)
        ids: list[int] = []
        for index, part in enumerate(self._special_re.split(text)):
            if index % 2:  # the pattern's capture group: a special token
                ids.append(self._special_ids[part])
            elif part:
                ids.extend(self.sp.encode(part) if index == 0 else self._encode_continuation(part))
        return ids

    def _encode_continuation(self, text: str) -> list[int]:
        """Ids of text that continues a sequence: no dummy-prefix space (encode after a marker, then drop it)."""
        if self._unk_piece is None:
            return self.sp.encode(text)
        marker = self.sp.encode(self._unk_piece)
        return self.sp.encode(self._unk_piece + text)[len(marker) :]

    def _decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)

    def _raw_piece(self, token_id: int) -> str:
        return self.sp.id_to_piece(token_id)

    def _piece(self, token_id: int) -> str:
        raw = self.sp.id_to_piece(token_id)
        if self.sp.is_byte(token_id) or self.sp.is_control(token_id) or self.sp.is_unknown(token_id):
            return raw  # <0xE4>, <s>, <unk>
        return raw.replace("\u2581", " ")


def _none_if_negative(value: int) -> int | None:
    return value if value >= 0 else None


# ---- HF tokenizers -------------------------------------------------------------------------------------------


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> byte (openai/gpt-2 encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _gpt2_byte_decoder()


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (from tokenizer.json, or built in memory from GGUF metadata)."""

    def __init__(
        self,
        tokenizer: Any,
        bos_id: int | None = None,
        eos_id: int | None = None,
        chat_template: str | None = None,
        add_bos: bool = False,
    ) -> None:
        self.tok = tokenizer
        self.bos_id, self.eos_id = bos_id, eos_id
        self.chat_template = chat_template
        self.add_bos = add_bos
        decoder = tokenizer.decoder
        self._byte_level = decoder is not None and '"ByteLevel"' in decoder.__getstate__().decode("utf-8", "replace")
        self._special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}

    @classmethod
    def from_folder(cls, folder: str | Path) -> "HFTokenizer":
        """tokenizer.json, with bos/eos, add_bos_token and chat_template from tokenizer_config.json when present."""
        from tokenizers import Tokenizer as RawTokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        try:
            raw = RawTokenizer.from_str(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from exc
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise FileFormatError(f"{path}: not a valid tokenizer.json ({exc})") from exc
        settings = _tokenizer_config(folder)
        bos = _token_id(raw, settings.get("bos_token"))
        eos = _token_id(raw, settings.get("eos_token"))
        add_bos = settings.get("add_bos_token")
        if add_bos is None:  # follow tokenizer.json's post-processor, as HF does
            with_specials = raw.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and len(with_specials) > 0 and with_specials[0] == bos
        return cls(raw, bos_id=bos, eos_id=eos, chat_template=_chat_template(folder, settings), add_bos=bool(add_bos))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def _encode_plain(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def _raw_piece(self, token_id: int) -> str:
        token = self.tok.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        return token

    def _piece(self, token_id: int) -> str:
        raw = self._raw_piece(token_id)
        if raw in self._special:
            return raw
        if self._byte_level and all(ch in _BYTE_DECODER for ch in raw):
            return display_bytes(bytes(_BYTE_DECODER[ch] for ch in raw))
        return raw.replace("\u2581", " ")  # Metaspace vocabularies (LLaMA's tokenizer.json); <0xE4> stays


def _read_bytes(path: str | Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from exc


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    path = folder / "tokenizer_config.json"
    if not path.exists():
        return {}
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise FileFormatError(f"{path}: cannot read ({exc.strerror or exc}); check the file") from exc
    data = parse_json(raw, str(path), FileFormatError, "check the file")
    return data if isinstance(data, dict) else {}


def _token_string(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _token_id(raw: Any, value: Any) -> int | None:
    text = _token_string(value)
    return raw.token_to_id(text) if text is not None else None


def _chat_template(folder: Path, settings: dict[str, Any]) -> str | None:
    """From tokenizer_config.json, or chat_template.jinja (where newer HF versions save it)."""
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if isinstance(template, str):
        return template
    jinja_file = folder / "chat_template.jinja"
    if not jinja_file.is_file():
        return None
    try:
        return jinja_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise FileFormatError(f"{jinja_file}: not readable as UTF-8 text ({exc}); check the file") from exc


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer of an HF model folder: tokenizer.json if present (as HF prefers), else tokenizer.model."""
    folder = Path(folder)
    if (folder / "tokenizer.json").exists():
        return HFTokenizer.from_folder(folder)
    if (folder / "tokenizer.model").exists():
        settings = _tokenizer_config(folder)
        processor_kwargs: dict[str, Any] = {"chat_template": _chat_template(folder, settings)}
        if settings.get("add_bos_token") is not None:
            processor_kwargs["add_bos"] = bool(settings["add_bos_token"])
        return SentencePieceTokenizer.from_file(folder / "tokenizer.model", **processor_kwargs)
    raise CheckpointError(f"{folder}: no tokenizer.json nor tokenizer.model; the model folder needs one of them")
