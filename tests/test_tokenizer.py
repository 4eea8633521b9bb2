"""Our tokenizers against HF transformers' tokenizer classes on the same files, display pieces, chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtrace.tracer.checkpoint.tokenizer import HFTokenizer, SentencePieceTokenizer, display_bytes, load_tokenizer
from llmtrace.tracer.core.errors import ConfigError

transformers = pytest.importorskip("transformers")
pytest.importorskip("google.protobuf")  # transformers needs it to convert a tokenizer.model

SAMPLE_PROMPTS = Path(__file__).resolve().parent.parent / "sample_prompts"
PROMPTS = [
    "今天天气真",
    "The capital of France is",
    "Hello 🙂 world 👍🏽!",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "x  =  [1,2,  3]\t# tabs\t\tand  runs   of spaces",
    "Once upon a time,  in a   small village",
    "数字 12345 和 emoji 🚀 混合",
    "<s>[INST] hi [/INST] hello</s> again",
    "\n newline first",
    "\t tab first",
    "",
]
LEADING_SPACE_PROMPTS = ["  leading spaces", " Paris", " 今天天气真"]

SMOLLM2_TEMPLATE = (  # SmolLM2-135M-Instruct's tokenizer_config.json
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA2_TEMPLATE = (  # Llama-2-chat's: bos/eos tokens, raise_exception, whitespace control
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "今天天气真好吗？"},
    {"role": "assistant", "content": "Yes."},
    {"role": "user", "content": "And tomorrow?"},
]


# ---- SentencePiece (tokenizer.model) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sp_pair(tiny_llama_dir: Path) -> tuple[SentencePieceTokenizer, object]:
    ours = load_tokenizer(tiny_llama_dir)
    assert isinstance(ours, SentencePieceTokenizer)
    return ours, transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.mark.parametrize("text", PROMPTS)
def test_sentencepiece_ids_equal_hf_llama_tokenizer(sp_pair: tuple, text: str) -> None:
    ours, hf = sp_pair
    assert type(hf).__name__ == "LlamaTokenizer"
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_bos=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", LEADING_SPACE_PROMPTS)
def test_sentencepiece_keeps_the_dummy_prefix_before_leading_whitespace(sp_pair: tuple, text: str) -> None:
    """sentencepiece (and llama.cpp) prefix '▁' even when the text starts with whitespace; HF's converted
    LlamaTokenizer skips it then. We follow sentencepiece, the tokenizer the model was trained with."""
    ours, hf = sp_pair
    ids = ours.encode(text, add_bos=False)
    assert ids == ours.sp.encode(text)
    pieces = [ours.sp.id_to_piece(i) for i in ids]
    hf_pieces = hf.convert_ids_to_tokens(hf.encode(text, add_special_tokens=False))
    assert "".join(pieces) == "▁" + "".join(hf_pieces)


def test_sentencepiece_decode_pieces_and_specials(sp_pair: tuple) -> None:
    ours, hf = sp_pair
    assert (ours.bos_id, ours.eos_id, ours.add_bos) == (1, 2, True)
    assert ours.vocab_size == len(hf) == hf.vocab_size
    for text in PROMPTS[:7]:
        assert ours.decode(ours.encode(text)) == text
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    ids = ours.encode("Hello 🙂")
    assert [ours.piece(i) for i in ids] == ["<s>", " ", "<0x48>", "e", "l", "l", "o", " ", "<0xF0>", "<0x9F>", "<0x99>",
                                            "<0x82>"]  # 'H' and 🙂 never occur in sample_prompts: byte fallback
    assert "".join(ours.piece(i) for i in ours.encode("the capital", add_bos=False)) == " the capital"
    assert ours.piece(ours.sp.piece_to_id("<0xF0>")) == "<0xF0>"


def test_ids_past_the_vocabulary_read_as_unnamed_pieces(sp_pair: tuple, llama_json_folder: Path,
                                                        byte_level_folder: Path) -> None:
    """A model whose embedding has rows the tokenizer does not name (padded HF vocabularies) may draw one: its text and
    piece say so instead of the run dying of sentencepiece's OUT_OF_RANGE or tokenizers' None."""
    for tok in (sp_pair[0], load_tokenizer(llama_json_folder), load_tokenizer(byte_level_folder)):
        size = tok.vocab_size
        ids = tok.encode("the capital", add_bos=False)
        assert tok.piece(size) == f"<unnamed {size}>" and tok.piece(size + 7) == f"<unnamed {size + 7}>"
        assert tok.decode([*ids, size, *ids]) == tok.decode(ids) + f"<unnamed {size}>" + tok.decode(ids)
        assert tok.decode([size + 1]) == f"<unnamed {size + 1}>"
        assert tok.decode(ids) == tok.decode(list(ids))  # the ordinary path is untouched


# ---- HF tokenizers (tokenizer.json) ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_json_folder(sp_pair: tuple, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF's own tokenizer.json conversion of the SentencePiece model (what LLaMA folders on the Hub ship)."""
    folder = tmp_path_factory.mktemp("llama-json")
    sp_pair[1].save_pretrained(folder)
    assert (folder / "tokenizer.json").exists()
    return folder


@pytest.fixture(scope="module")
def byte_level_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPT-2-style byte-level BPE (SmolLM2's kind) trained on sample_prompts/, with SmolLM2's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = "".join(p.read_text(encoding="utf-8") for p in sorted(SAMPLE_PROMPTS.glob("*.txt")))
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(text.splitlines(), trainer)
    folder = tmp_path_factory.mktemp("byte-level")
    raw.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": SMOLLM2_TEMPLATE,
                "tokenizer_class": "GPT2Tokenizer"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder


@pytest.mark.parametrize("text", PROMPTS + LEADING_SPACE_PROMPTS + ["<|im_start|>user\nhi<|im_end|>\n"])
def test_tokenizer_json_ids_equal_hf(llama_json_folder: Path, byte_level_folder: Path, text: str) -> None:
    for folder in (llama_json_folder, byte_level_folder):
        ours, hf = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
        assert isinstance(ours, HFTokenizer)
        assert ours.encode(text) == hf.encode(text), folder.name
        assert ours.decode(ours.encode(text, add_bos=False)) == hf.decode(hf.encode(text, add_special_tokens=False))


def test_tokenizer_json_reads_bos_eos_and_the_bos_default(llama_json_folder: Path, byte_level_folder: Path) -> None:
    llama = load_tokenizer(llama_json_folder)
    assert (llama.bos_id, llama.eos_id, llama.add_bos) == (1, 2, True)
    smol = load_tokenizer(byte_level_folder)
    assert (smol.bos_id, smol.eos_id, smol.add_bos) == (1, 2, False)
    assert smol.encode("hi", add_bos=True)[0] == 1


def test_byte_level_pieces_show_partial_characters_as_bytes(byte_level_folder: Path) -> None:
    ours = load_tokenizer(byte_level_folder)
    pieces = [ours.piece(i) for i in ours.encode("🙂 ok")]
    assert pieces[:4] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]  # 🙂 is not in the tiny vocabulary: 4 byte tokens
    assert "".join(pieces[4:]) == " ok"
    assert ours.piece(1) == "<|im_start|>"
    assert "".join(ours.piece(i) for i in ours.encode("The capital of France is")) == "The capital of France is"


def test_display_bytes() -> None:
    assert display_bytes("今".encode()) == "今"
    assert display_bytes("今".encode()[:2]) == "<0xE4><0xBB>"
    assert display_bytes(b" a\xe4\xbb") == " a<0xE4><0xBB>"
    assert display_bytes(b"\xff" + "天".encode()) == "<0xFF>天"


# ---- chat templates ------------------------------------------------------------------------------------------------


def test_chat_template_renders_like_hf(byte_level_folder: Path, tiny_llama_dir: Path) -> None:
    smol = load_tokenizer(byte_level_folder)
    hf_smol = transformers.AutoTokenizer.from_pretrained(byte_level_folder)
    for messages in (CHAT[1:2], CHAT):
        expected = hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert smol.apply_chat_template(messages) == expected
    assert smol.apply_chat_template(CHAT[1:2]).startswith("<|im_start|>system\nYou are a helpful AI assistant")

    llama = load_tokenizer(tiny_llama_dir)
    llama.chat_template = LLAMA2_TEMPLATE
    hf_llama = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    hf_llama.chat_template = LLAMA2_TEMPLATE
    rendered = llama.apply_chat_template(CHAT, add_generation_prompt=False)
    assert rendered == hf_llama.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    assert rendered.startswith("<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\n今天天气真好吗？ [/INST] Yes. </s>")
    assert llama.encode(rendered, add_bos=False) == hf_llama.encode(rendered, add_special_tokens=False)


def test_chat_template_errors_are_config_errors(tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_dir)
    assert tokenizer.chat_template is None
    with pytest.raises(ConfigError, match="no chat template"):
        tokenizer.apply_chat_template(CHAT)
    tokenizer.chat_template = LLAMA2_TEMPLATE
    with pytest.raises(ConfigError, match="roles must alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }"
    with pytest.raises(ConfigError, match="not valid Jinja"):
        tokenizer.apply_chat_template(CHAT)
    tokenizer.chat_template = "{{ ''.__class__.__mro__ }}"
    with pytest.raises(ConfigError, match="failed to render"):  # the sandbox refuses attribute escapes
        tokenizer.apply_chat_template(CHAT)
