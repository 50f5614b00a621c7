"""The tokenizer built from a GGUF file's vocabulary, on the Rust `tokenizers` library.

A GGUF stores no `tokenizer.json`: only tokens, merges (or scores), token types and a pre-tokenizer
*name*. For byte-level BPE (model "gpt2") we rebuild the pipeline llama.cpp runs for that name; for
SentencePiece BPE (model "llama") see spm_tokenizer.py. Either way the ids we feed the model are the
ids it was trained on. Invariants:
  - id i is `tokens[i]` for every i: the vocabulary never grows, whatever tokens are added;
  - control tokens (type 3) are special: parsed whole from text, dropped by `decode(skip_special=True)`;
  - user-defined tokens (type 4) are parsed whole from text but are ordinary text on decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _RustTokenizer

from shared.errors import ModelLoadError

from .chat_template import default_chat_template
from .spm_tokenizer import spm_backend_from_gguf, spm_max_token_bytes

if TYPE_CHECKING:  # the loader pulls in torch; tokenizing text should not
    from cloud.model.gguf_vocab import GGUFTokenizerData

_CONTROL, _USER_DEFINED = 3, 4

# Split regexes as llama.cpp's llama-vocab.cpp (and the models' own tokenizer.json files) write them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")

# GGUF `tokenizer.ggml.pre` name -> pre-tokenizer family, grouped as llama.cpp's llama-vocab.cpp
# groups them. "default" is what a file without the key means; llama.cpp's fallback for it is a
# warned-about approximation, so we take plain GPT-2 ("gpt2" is the common misspelling of "gpt-2").
_PRE_FAMILIES: dict[str, str] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais"), "gpt2"),
    # llama.cpp splits every \p{N} character off before the GPT-2 regex for these; so does
    # SmolLM2's tokenizer.json (Digits(individual_digits=True) then ByteLevel).
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), "digits"
    ),
    **dict.fromkeys(_LLAMA3_NAMES, "llama3"),
    **dict.fromkeys(("dbrx", "smaug-bpe"), "llama3"),
    # Qwen2's tokenizer.json also NFC-normalizes; llama.cpp does not, and we follow llama.cpp.
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2"), "qwen2"),
}
# llama.cpp (like Llama 3's tokenizer.json) looks a whole pre-token up in the vocabulary before
# merging for these names only; dbrx and smaug-bpe share the regex but not this.
_IGNORE_MERGES = frozenset(_LLAMA3_NAMES)

# End-of-turn tokens, found by name as llama.cpp finds its end-of-generation set. Instruct models end
# a turn with these even when the file's eos id names another (a ChatML model may list
# <|endoftext|> as eos yet answer with <|im_end|>), so stopping on eos alone would run past the answer.
_END_OF_TURN_NAMES = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)


def _pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """The pre-tokenizer for a GGUF `pre` name, and whether BPE takes whole in-vocab words first."""
    family = _PRE_FAMILIES.get(pre)
    if family is None:
        known = ", ".join(sorted(_PRE_FAMILIES))
        raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {known}")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=family in ("gpt2", "digits"))
    if family == "gpt2":
        return byte_level, False
    if family == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), False
    split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT), "isolated")
    return pre_tokenizers.Sequence([split, byte_level]), pre in _IGNORE_MERGES


def _backend_from_gguf(data: GGUFTokenizerData) -> _RustTokenizer:
    if len(data.token_types) not in (0, len(data.tokens)):
        raise ModelLoadError(f"GGUF lists {len(data.tokens)} tokens but {len(data.token_types)} token types")
    types = data.token_types or [1] * len(data.tokens)
    vocab = {token: i for i, token in enumerate(data.tokens)}
    if len(vocab) != len(data.tokens):
        raise ModelLoadError("GGUF vocabulary holds duplicate token strings; ids would be ambiguous")
    merges: list[tuple[str, str]] = []
    for merge in data.merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelLoadError(f"malformed GGUF merge {merge!r}")
        merges.append((left, right))
    pre, ignore_merges = _pre_tokenizer(data.pre)
    backend = _RustTokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    # Added tokens keep their file spelling, which is also their vocab key, so each keeps its id.
    # normalized=False: match the exact text, as llama.cpp's special-token pass does.
    added = [
        AddedToken(token, special=kind == _CONTROL, normalized=False)
        for token, kind in zip(data.tokens, types, strict=True)
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    backend.add_tokens([t for t in added if not t.special])
    backend.add_special_tokens([t for t in added if t.special])
    if backend.get_vocab_size(with_added_tokens=True) != len(data.tokens):
        raise ModelLoadError("GGUF added tokens do not map onto the vocabulary")
    return backend


def _max_token_bytes(backend: _RustTokenizer, byte_level: bool, byte_fallback: bool) -> int | None:
    """The most bytes of text one token stands for, where every byte of a text ends up in exactly one
    token (byte-level BPE or SentencePiece with byte fallback, no normalizer): then a text of n bytes
    is at least n / this many tokens, which refuses a prompt too long for the context before it is
    tokenized. None where that bound does not hold (a normalizer may drop characters)."""
    if backend.normalizer is not None:
        return None
    if byte_fallback:
        return spm_max_token_bytes(backend)
    if not byte_level:
        return None
    # byte-level vocabulary strings map one character to one byte; added tokens match their text
    longest = max((len(piece) for piece in backend.get_vocab(with_added_tokens=False)), default=1)
    added = backend.get_added_tokens_decoder().values()
    return max([longest, *(len(t.content.encode()) for t in added)])


class Tokenizer:
    """Text <-> token ids for one model. Safe to share across threads: nothing mutates the backend."""

    def __init__(
        self,
        backend: _RustTokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        # GPT-2 style byte-level vocabulary ("Ġthe"), as grammar engines need to know
        self.byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        # SentencePiece style ("▁the", bytes as "<0xE2>"): xgrammar's BYTE_FALLBACK vocabulary
        model = backend.model
        self.byte_fallback = isinstance(model, models.BPE) and bool(model.byte_fallback)
        ends = {backend.token_to_id(name) for name in _END_OF_TURN_NAMES} | {eos_id}
        self.eos_ids: frozenset[int] = frozenset(i for i in ends if i is not None)
        added = backend.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.max_token_bytes = _max_token_bytes(backend, self.byte_level, self.byte_fallback)

    def backend_json(self) -> str:
        """The vocabulary and rules in the `tokenizers` library's own serialization."""
        return str(self._backend.to_str())

    @classmethod
    def from_backend_json(
        cls,
        backend_json: str,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        add_eos: bool,
        chat_template: str | None = None,
    ) -> Tokenizer:
        return cls(
            _RustTokenizer.from_str(backend_json),
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos=add_bos,
            add_eos=add_eos,
            chat_template=chat_template,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled as the backend's JSON: an engine process hands its tokenizer to the gateway
        state = (
            self.backend_json(),
            self.bos_id,
            self.eos_id,
            self.add_bos,
            self.add_eos,
            self.chat_template,
        )
        return (_unpickle_tokenizer, state)

    @classmethod
    def from_gguf_data(cls, data: GGUFTokenizerData) -> Tokenizer:
        backend = spm_backend_from_gguf(data) if data.model == "llama" else _backend_from_gguf(data)
        return cls(
            backend,
            bos_id=data.bos_id,
            eos_id=data.eos_id,
            add_bos=data.add_bos,
            add_eos=data.add_eos,
            chat_template=data.chat_template or default_chat_template(data.arch),
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        from cloud.model.gguf_vocab import load_gguf_tokenizer

        return cls.from_gguf_data(load_gguf_tokenizer(path))

    @classmethod
    def from_hf_file(
        cls,
        path: str | Path,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> Tokenizer:
        """Load a Hugging Face `tokenizer.json`; ids that file does not carry are passed in."""
        try:
            backend = _RustTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception for missing or malformed files
            raise ModelLoadError(f"cannot load tokenizer file {path}: {exc}") from exc
        return cls(backend, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos, chat_template=chat_template)

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in it (e.g. `<|im_start|>`) become their ids.

        `add_special` prepends BOS and appends EOS where the model asks (GGUF `add_bos_token`,
        `add_eos_token`).
        """
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` (as `encode`, no BOS) and each token's character span in it."""
        enc = self._backend.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of `ids`; bytes that do not form whole UTF-8 characters come out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary spelling of id `i` (byte-level "Ġthe", SentencePiece "▁the" or "<0xE2>"), or
        None outside the vocabulary."""
        return self._backend.id_to_token(i)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)


def _unpickle_tokenizer(
    backend_json: str,
    bos_id: int | None,
    eos_id: int | None,
    add_bos: bool,
    add_eos: bool,
    chat_template: str | None,
) -> Tokenizer:
    return Tokenizer.from_backend_json(
        backend_json,
        bos_id=bos_id,
        eos_id=eos_id,
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=chat_template,
    )
