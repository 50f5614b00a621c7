"""SentencePiece BPE from a GGUF (model "llama"): Gemma 3's ids are transformers' ids.

Reference: transformers' GGUF tokenizer converter (what `AutoTokenizer.from_pretrained(dir,
gguf_file=...)` runs once it has read the file) fed the metadata our loader read; the file reading
itself is pinned by ids taken from `AutoTokenizer.from_pretrained` on the same file. Reading the
262,144 pieces twice would double the cost of this module. The small synthetic vocabularies below
hold what Gemma's file cannot show (score order, the space prefix, refusals).
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest

from cloud.model.chat_template import ChatTemplate, default_chat_template
from cloud.model.detokenizer import IncrementalDecoder
from cloud.model.gguf_vocab import GGUFTokenizerData, read_tokenizer_data
from cloud.model.tokenizer import Tokenizer
from shared.errors import ModelLoadError

# U+1FAE8 and U+E0001 have no piece of their own: byte fallback (4 <0xXX> pieces each)
BYTE_FALLBACK_TEXT = "shaking face \U0001fae8, tag \U000e0001."
CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. I'm sure you'll agree; they've DON'T.",
    "def f(x):\n    if x:\n\treturn {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\n\n    pass\n",
    'if (a && b) { printf("%d\\n", a->c[0]); } // C\r\n',
    "日本語のテキストと中文文本，还有한국어 텍스트。 Ünïcödé: naïve café, Straße, русский, العربية",
    "emoji 😀😃😄 👍🏽 👩‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️‍🔥 🧑🏿‍🚀",
    BYTE_FALLBACK_TEXT,
    "pi = 3.14159265358979323846, n = 1234567890, 2024-06-01T12:34:56Z, 1e-9, 0xDEADBEEF, x² ½ ①",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>",
    "text<eos>more <start_of_turn without close </div><div>[multimodal]",
    "   leading and trailing   ",
    "runs    of     spaces      and\t\ttabs\t \t and  \n\n\n newlines \n \n",
    " ",
    "\n",
    "",
    "combining e\u0301 vs é, zero\u200bwidth, nbsp\u00a0here, BOM\ufeff",
]
# AutoTokenizer.from_pretrained(dir, gguf_file="gemma-3-270m-q4_k_m.gguf") (transformers 5.24), with BOS
PINNED = {
    "Hello  world   x\n\n  y <start_of_turn>user": [
        2,
        9259,
        138,
        12392,
        139,
        236781,
        108,
        138,
        236762,
        236743,
        105,
        2364,
    ],
    BYTE_FALLBACK_TEXT: [
        2,
        1179,
        1557,
        3392,
        236743,
        478,
        397,
        409,
        406,
        236764,
        7853,
        236743,
        481,
        398,
        366,
        367,
        236761,
    ],
}


@pytest.fixture(scope="module")
def gemma_data(gemma_reader: Any) -> GGUFTokenizerData:
    return read_tokenizer_data(gemma_reader)


@pytest.fixture(scope="module")
def gemma(gemma_data: GGUFTokenizerData) -> Tokenizer:
    return Tokenizer.from_gguf_data(gemma_data)


@pytest.fixture(scope="module")
def reference(gemma_data: GGUFTokenizerData) -> Any:
    """transformers' tokenizer for this file, converted from the metadata our loader read."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    fields = {
        "tokenizer_type": gemma_data.model,
        "pre_tokenizer_type": gemma_data.pre,
        "tokens": gemma_data.tokens,
        "scores": gemma_data.scores,
        "token_type": gemma_data.token_types,
        "bos_token_id": gemma_data.bos_id,
        "eos_token_id": gemma_data.eos_id,
        "add_prefix_space": gemma_data.add_space_prefix,
    }
    backend, _ = mapping.convert_gguf_tokenizer(gemma_data.arch, fields)
    return backend


def test_encode_matches_transformers_on_a_varied_corpus(gemma: Tokenizer, reference: Any) -> None:
    wrong = [
        (text, gemma.encode(text), reference.encode(text, add_special_tokens=False).ids)
        for text in CORPUS
        if gemma.encode(text) != reference.encode(text, add_special_tokens=False).ids
    ]
    assert not wrong
    for text, ids in PINNED.items():
        assert gemma.encode(text, add_special=True) == ids


def test_decode_matches_transformers_and_round_trips(gemma: Tokenizer, reference: Any) -> None:
    for text in CORPUS:
        ids = gemma.encode(text)
        assert gemma.decode(ids, skip_special=False) == text
        for skip in (True, False):
            assert gemma.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip)
    fallback = [gemma.id_to_token(i) for i in gemma.encode("\U0001fae8")]
    assert fallback == ["<0xF0>", "<0x9F>", "<0xAB>", "<0xA8>"]


def test_control_tokens_are_special_and_user_defined_ones_whole(gemma: Tokenizer) -> None:
    ids = gemma.encode("<start_of_turn>user\nhi</div><end_of_turn>")
    assert ids == [105, 2364, 107, 2202, 235, 106]
    assert {105, 106} <= gemma.special_ids and not {107, 235} & gemma.special_ids
    assert gemma.decode(ids) == "user\nhi</div>"
    # Gemma answers with <end_of_turn>; its file names <eos> as eos
    assert gemma.eos_ids == frozenset({1, 106})
    assert (gemma.bos_id, gemma.add_bos, gemma.encode("hi", add_special=True)) == (2, True, [2, 2202])


def test_what_the_engine_reads_is_right_for_a_sentencepiece_vocabulary(
    gemma: Tokenizer, gemma_data: GGUFTokenizerData
) -> None:
    assert (gemma.byte_level, gemma.byte_fallback, gemma.vocab_size) == (False, True, 262_144)
    # whitespace runs are stored with real spaces in the file, spelled with "▁" here
    assert (gemma_data.tokens[138], gemma.id_to_token(138)) == ("  ", "▁▁")
    assert gemma.id_to_token(2202) == "hi" and gemma.id_to_token(gemma.vocab_size) is None
    # the longest piece is 16 three-byte characters; no text packs more bytes into one token
    assert gemma.max_token_bytes == 48
    for text in CORPUS:
        assert len(gemma.encode(text)) * 48 >= len(text.encode())


def test_a_gguf_without_template_gets_gemmas_turn_format(
    gemma: Tokenizer, gemma_data: GGUFTokenizerData
) -> None:
    assert gemma_data.chat_template is None and gemma_data.arch == "gemma3"
    assert gemma.chat_template == default_chat_template("gemma3")
    template = ChatTemplate(gemma.chat_template, "<bos>", "<eos>")
    ids = gemma.encode(template.render([{"role": "user", "content": "hi"}]))
    # one BOS (the template writes it; prompts are encoded without adding another), then the turns
    assert ids == [2, 105, 2364, 107, 2202, 106, 107, 105, 4368, 107]


def test_streaming_detokenization_of_sentencepiece_pieces(gemma: Tokenizer) -> None:
    ids = gemma.encode("  lead " + BYTE_FALLBACK_TEXT + "  <start_of_turn>x")
    for skip in (True, False):
        decoder = IncrementalDecoder(gemma, skip_special=skip)
        pieces = [decoder.feed([i]) for i in ids] + [decoder.flush()]
        assert "".join(pieces) == gemma.decode(ids, skip)
        assert not any("\ufffd" in p for p in pieces)
    assert pieces[:2] == ["  ", "lead"]  # "▁▁" then "lead": the spaces come out at once


def test_logprob_bytes_of_sentencepiece_tokens_are_the_text_bytes(gemma: Tokenizer) -> None:
    from gateway.openai.logprobs import TokenTexts

    text = "café, naïve  " + BYTE_FALLBACK_TEXT
    texts = TokenTexts(gemma)
    # OpenAI's `bytes` of each token, concatenated, are the UTF-8 of the text: "é" is two bytes,
    # "<0xF0>" one byte, "▁" a space
    assert b"".join(bytes(texts.get(i)[1]) for i in gemma.encode(text)) == text.encode()


def test_pickled_tokenizer_works_as_the_original(gemma: Tokenizer) -> None:
    """An engine process hands its tokenizer to the gateway this way."""
    copy: Tokenizer = pickle.loads(pickle.dumps(gemma))
    for text in CORPUS:
        assert copy.encode(text, add_special=True) == gemma.encode(text, add_special=True)
    facts = ("eos_ids", "special_ids", "vocab_size", "byte_level", "byte_fallback", "max_token_bytes")
    assert [getattr(copy, f) for f in facts] == [getattr(gemma, f) for f in facts]
    assert copy.chat_template == gemma.chat_template


def test_xgrammar_reads_the_vocabulary_as_byte_fallback(gemma: Tokenizer) -> None:
    xgr = pytest.importorskip("xgrammar")
    from cloud.grammar.compiler import tokenizer_info

    info = tokenizer_info(gemma, gemma.vocab_size)
    assert info.vocab_type == xgr.VocabType.BYTE_FALLBACK
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        '{"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}',
        any_whitespace=False,
    )
    # "▁" pieces must count as spaces and <0xXX> pieces as bytes, or this valid instance is refused
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(i) for i in gemma.encode('{"s": "a  b \U0001fae8"}'))
    assert matcher.accept_token(1)


# -- synthetic vocabularies ------------------------------------------------------------------------

_BYTES = [f"<0x{b:02X}>" for b in range(256)]


def _spm(pieces: dict[str, float], **changes: Any) -> GGUFTokenizerData:
    """unk, bos, eos, the 256 byte pieces, then `pieces` (normal, with these scores)."""
    tokens = ["<unk>", "<s>", "</s>", *_BYTES, *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *pieces.values()]
    data = GGUFTokenizerData(
        model="llama",
        pre="default",
        tokens=tokens,
        token_types=types,
        merges=[],
        bos_id=1,
        eos_id=2,
        add_bos=True,
        chat_template=None,
        scores=scores,
    )
    return dataclasses.replace(data, **changes)


def _pieces(tok: Tokenizer, text: str) -> list[str | None]:
    return [tok.id_to_token(i) for i in tok.encode(text)]


def test_merges_follow_scores_not_file_order() -> None:
    # "ab" comes first in the file but scores below "bc": SentencePiece merges "bc" first
    tok = Tokenizer.from_gguf_data(_spm({"a": -1, "b": -2, "c": -3, "ab": -20, "bc": -10, "▁": -4}))
    assert _pieces(tok, "abc") == ["a", "bc"]
    assert _pieces(tok, "ab c") == ["ab", "▁", "c"]
    assert _pieces(tok, "aé") == ["a", "<0xC3>", "<0xA9>"]  # no piece for "é": its UTF-8 bytes
    assert tok.decode(tok.encode("ab cé")) == "ab cé"


def test_space_prefix_is_added_when_the_file_asks() -> None:
    pieces = {"▁": -1, "h": -2, "i": -3, "hi": -4, "▁hi": -5}
    plain = Tokenizer.from_gguf_data(_spm(pieces))
    prefixed = Tokenizer.from_gguf_data(_spm(pieces, add_space_prefix=True))
    assert _pieces(plain, "hi hi") == ["hi", "▁hi"]
    assert _pieces(prefixed, "hi hi") == ["▁hi", "▁hi"]
    assert prefixed.decode(prefixed.encode("hi hi")) == "hi hi"  # the added space is removed again


def test_whitespace_run_pieces_stored_with_spaces_are_built_from_spaces() -> None:
    data = _spm({"▁": -1, "a": -2, "▁a": -3})
    data = dataclasses.replace(
        data, tokens=[*data.tokens, "  "], token_types=[*data.token_types, 4], scores=[*data.scores, -1000.0]
    )
    tok = Tokenizer.from_gguf_data(data)
    # user-defined and other non-normal pieces rank before every normal one, whatever their score
    assert _pieces(tok, "  a") == ["▁▁", "a"]
    assert tok.decode(tok.encode("a  a")) == "a  a"


def test_inconsistent_sentencepiece_files_are_refused() -> None:
    data = _spm({"a": -1, "▁▁": -2})
    with pytest.raises(ModelLoadError, match="scores"):
        Tokenizer.from_gguf_data(dataclasses.replace(data, scores=data.scores[:-1]))
    with pytest.raises(ModelLoadError, match="duplicate"):
        # "  " is spelled "▁▁", which the file already has
        Tokenizer.from_gguf_data(
            dataclasses.replace(
                data,
                tokens=[*data.tokens, "  "],
                token_types=[*data.token_types, 4],
                scores=[*data.scores, 0.0],
            )
        )
