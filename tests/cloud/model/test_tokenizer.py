"""The GGUF tokenizer yields the ids llama.cpp (and the model's own tokenizer.json) would.

Reference: transformers' tokenizer for the same GGUF file. Its GGUF converter gives smollm-family
files a plain GPT-2 ByteLevel pre-tokenizer and so does NOT split digits as llama.cpp and SmolLM2's
tokenizer.json do; with this vocabulary that changes non-ASCII numerals (" ²" becomes "ĠÂ", "²"
instead of "Ġ", "Â²"). So for those files the reference is transformers' converted vocabulary and
merges behind SmolLM2's published pre-tokenizer, wrapped in a `PreTrainedTokenizerFast`.
"""

from __future__ import annotations

import dataclasses
import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from cloud.model.gguf_vocab import GGUFTokenizerData, load_gguf_tokenizer
from cloud.model.tokenizer import Tokenizer, _pre_tokenizer
from shared.errors import ModelLoadError

_DIGIT_SPLITTING_PRES = {"smollm", "starcoder", "refact", "codeshell", "command-r"}
# SmolLM2-135M-Instruct tokenizer.json, "pre_tokenizer".
_SMOLLM2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}
_NUMERALS = "".join(chr(c) for c in range(0x3000) if unicodedata.category(chr(c)).startswith("N"))

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. I'm sure you'll agree; they've DON'T WE'LL.",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский язык, עברית, العربية, हिन्दी",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "emoji 😀😃😄 👍🏽 👩‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️‍🔥 🧑🏿‍🚀",
    "def f(x):\n\treturn {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    'if (a && b) { printf("%d\\n", a->c[0]); } // C\r\n',
    "pi = 3.14159265358979323846264338327950288, n = 1234567890123456789012345678901234567890",
    "phone +1 (555) 010-9999, 2024-06-01T12:34:56Z, 1e-9, 0xDEADBEEF, 12,345.67",
    "x² + y³ = ½ ¾ ① ⅷ ٣٤٥ ४२ 〇 二",
    _NUMERALS,
    " ".join(_NUMERALS),
    "runs    of     spaces      and\t\ttabs\t \t and  \n\n\n newlines \n \n",
    "   leading and trailing   ",
    "\n",
    "",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "text<|endoftext|>more <|im_end|>tail and a half-special <|im_start without close",
    "<file_sep><filename>a.py\nprint(1)<jupyter_code>",
    "combining e\u0301 vs é, zero\u200bwidth, nbsp\u00a0here, BOM\ufeff, replacement \ufffd",
]


def _reference_backend(hf: Any, pre: str) -> Any:
    if pre not in _DIGIT_SPLITTING_PRES:
        return hf
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(hf.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = _SMOLLM2_PRE_TOKENIZER
    backend = RustTokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=hf.bos_token, eos_token=hf.eos_token)


@pytest.fixture(scope="session")
def tok_data(gguf_path: Path) -> GGUFTokenizerData:
    return load_gguf_tokenizer(gguf_path)


@pytest.fixture(scope="session")
def tok(tok_data: GGUFTokenizerData) -> Tokenizer:
    return Tokenizer.from_gguf_data(tok_data)


@pytest.fixture(scope="session")
def hf_gguf(gguf_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def reference(hf_gguf: Any, tok_data: GGUFTokenizerData) -> Any:
    return _reference_backend(hf_gguf, tok_data.pre)


@pytest.mark.parametrize("text", CORPUS, ids=[f"corpus{i}" for i in range(len(CORPUS))])
def test_encode_matches_reference_token_for_token(tok: Tokenizer, reference: Any, text: str) -> None:
    expected = reference.encode(text, add_special_tokens=False)
    got = tok.encode(text)
    assert got == expected, (
        [tok.id_to_token(i) for i in got],
        reference.convert_ids_to_tokens(expected),
    )


@pytest.mark.parametrize("skip_special", [True, False])
def test_decode_matches_reference(tok: Tokenizer, reference: Any, skip_special: bool) -> None:
    for text in CORPUS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special=skip_special) == reference.decode(
            ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False
        )


def test_decode_round_trips_every_corpus_text(tok: Tokenizer) -> None:
    for text in CORPUS:
        assert tok.decode(tok.encode(text), skip_special=False) == text


def test_control_tokens_in_text_are_single_ids_and_skipped_on_decode(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert ids[-1] == tok.token_to_id("<|im_end|>")
    assert tok.decode(ids) == "user\nhi"


def test_user_defined_tokens_are_parsed_whole_but_kept_on_decode(tok_data: GGUFTokenizerData) -> None:
    types = list(tok_data.token_types)
    repo = tok_data.tokens.index("<repo_name>") if "<repo_name>" in tok_data.tokens else 3
    types[repo] = 4
    user = Tokenizer.from_gguf_data(dataclasses.replace(tok_data, token_types=types))
    ids = user.encode(f"a{tok_data.tokens[repo]}b")
    assert repo in ids
    assert repo not in user.special_ids
    assert user.decode(ids) == f"a{tok_data.tokens[repo]}b"


def test_smollm_splits_each_numeral_before_bpe(tok: Tokenizer, tok_data: GGUFTokenizerData) -> None:
    if tok_data.pre != "smollm":
        pytest.skip("SmolLM2-specific vocabulary")
    # Without the digit split, BPE would merge the space with the first byte of "²" ("ĠÂ", "²").
    assert [tok.id_to_token(i) for i in tok.encode("x ² 12")] == ["x", "Ġ", "Â²", "Ġ", "1", "2"]


def test_eos_ids_hold_the_file_eos_and_end_of_turn_tokens(
    tok: Tokenizer, tok_data: GGUFTokenizerData
) -> None:
    assert tok.eos_id == tok_data.eos_id
    assert tok.eos_id in tok.eos_ids
    for name in ("<|im_end|>", "<|endoftext|>"):
        i = tok.token_to_id(name)
        if i is not None:
            assert i in tok.eos_ids
    assert tok.token_to_id("<|im_start|>") not in tok.eos_ids


def test_vocab_size_and_ids_follow_the_file(tok: Tokenizer, tok_data: GGUFTokenizerData) -> None:
    assert tok.vocab_size == len(tok_data.tokens)
    for i in (0, 1, 2, 100, len(tok_data.tokens) - 1):
        assert tok.id_to_token(i) == tok_data.tokens[i]
    assert tok.id_to_token(len(tok_data.tokens)) is None


def test_add_special_prepends_bos_only_when_the_model_asks(tok_data: GGUFTokenizerData) -> None:
    with_bos = Tokenizer.from_gguf_data(dataclasses.replace(tok_data, add_bos=True, bos_id=1))
    assert with_bos.encode("hi", add_special=True) == [1, *with_bos.encode("hi")]
    without = Tokenizer.from_gguf_data(dataclasses.replace(tok_data, add_bos=False))
    assert without.encode("hi", add_special=True) == without.encode("hi")


def test_unknown_pre_tokenizer_is_a_model_load_error(tok_data: GGUFTokenizerData) -> None:
    with pytest.raises(ModelLoadError, match="mystery-pre"):
        Tokenizer.from_gguf_data(dataclasses.replace(tok_data, pre="mystery-pre"))


def test_mismatched_token_types_are_a_model_load_error(tok_data: GGUFTokenizerData) -> None:
    with pytest.raises(ModelLoadError, match="token types"):
        Tokenizer.from_gguf_data(dataclasses.replace(tok_data, token_types=[1, 3]))


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt2", ["abc", "Ġ12345", "ĠÂ²", "Ġdon", "'", "T"]),
        ("smollm", ["abc", "Ġ", "1", "2", "3", "4", "5", "Ġ", "Â²", "Ġdon", "'", "T"]),
        ("llama-bpe", ["abc", "Ġ", "123", "45", "Ġ", "Â²", "Ġdon", "'T"]),
        ("qwen2", ["abc", "Ġ", "1", "2", "3", "4", "5", "Ġ", "Â²", "Ġdon", "'T"]),
    ],
)
def test_pre_tokenizer_splits_as_llama_cpp(pre: str, pieces: list[str]) -> None:
    # Numerals: one piece (gpt2), each alone (smollm, qwen2), groups of three (llama3);
    # contractions match case-insensitively only in the llama3 and qwen2 regexes.
    pre_tokenizer, _ = _pre_tokenizer(pre)
    assert [p for p, _ in pre_tokenizer.pre_tokenize_str("abc 12345 ² don'T")] == pieces


def test_from_hf_file_loads_a_tokenizer_json(tok: Tokenizer, reference: Any, tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    reference.backend_tokenizer.save(str(path))
    loaded = Tokenizer.from_hf_file(path, bos_id=tok.bos_id, eos_id=tok.eos_id)
    for text in CORPUS:
        assert loaded.encode(text) == tok.encode(text)
    assert loaded.eos_ids == tok.eos_ids


def test_from_hf_file_missing_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        Tokenizer.from_hf_file(tmp_path / "absent.json")


def test_a_pickled_tokenizer_and_template_work_as_the_originals(tok: Tokenizer) -> None:
    """An engine process hands its tokenizer and chat template to the gateway this way."""
    import pickle

    from cloud.model.chat_template import ChatTemplate

    template = ChatTemplate(tok.chat_template, "<|im_start|>", "<|im_end|>")
    tok2, template2 = pickle.loads(pickle.dumps((tok, template)))
    for text in ["Hello, world!", "ünïcödé 日本語 12345", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok2.encode(text, add_special=True) == tok.encode(text, add_special=True)
    assert (tok2.eos_ids, tok2.special_ids, tok2.vocab_size, tok2.byte_level) == (
        tok.eos_ids,
        tok.special_ids,
        tok.vocab_size,
        tok.byte_level,
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert template2.render(messages) == template.render(messages)
