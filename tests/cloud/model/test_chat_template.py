"""The GGUF chat template renders as transformers renders it; bad input is the client's error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cloud.model.chat_template import CHATML_TEMPLATE, ChatTemplate, default_chat_template
from cloud.model.gguf_vocab import GGUFTokenizerData, load_gguf_tokenizer
from shared.errors import InvalidRequestError, ModelLoadError

TWO_TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan? Answer <b>briefly</b> & in 日本語 😀."},
]


@pytest.fixture(scope="module")
def tok_data(gguf_path: Path) -> GGUFTokenizerData:
    return load_gguf_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def template(tok_data: GGUFTokenizerData) -> ChatTemplate:
    def name(i: int | None) -> str:
        return tok_data.tokens[i] if i is not None else ""

    return ChatTemplate(tok_data.chat_template, name(tok_data.bos_id), name(tok_data.eos_id))


@pytest.fixture(scope="module")
def hf_gguf(gguf_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.mark.parametrize("with_system", [False, True], ids=["default-system", "given-system"])
def test_two_turns_render_as_transformers_does(
    template: ChatTemplate, hf_gguf: Any, with_system: bool
) -> None:
    system = [{"role": "system", "content": "You are terse."}]
    messages = system + TWO_TURNS if with_system else TWO_TURNS
    expected = hf_gguf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert template.render(messages, add_generation_prompt=True) == expected


def test_default_system_prompt_is_inserted_when_none_given(
    template: ChatTemplate, tok_data: GGUFTokenizerData
) -> None:
    if "named SmolLM" not in (tok_data.chat_template or ""):
        pytest.skip("SmolLM2-specific template")
    rendered = template.render(TWO_TURNS)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>assistant\n")
    given = template.render([{"role": "system", "content": "Be terse."}, *TWO_TURNS])
    assert given.count("<|im_start|>system") == 1
    assert "named SmolLM" not in given


def test_without_generation_prompt_ends_after_last_message(template: ChatTemplate, hf_gguf: Any) -> None:
    expected = hf_gguf.apply_chat_template(TWO_TURNS, tokenize=False, add_generation_prompt=False)
    assert template.render(TWO_TURNS, add_generation_prompt=False) == expected


def test_missing_template_falls_back_to_chatml() -> None:
    rendered = ChatTemplate(None).render([{"role": "user", "content": "hi"}])
    assert ChatTemplate(None).source == CHATML_TEMPLATE
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_raise_exception_becomes_invalid_request_with_the_reason() -> None:
    strict = ChatTemplate(
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('Conversation roles must be user or assistant') }}{% endif %}{% endfor %}"
    )
    with pytest.raises(InvalidRequestError, match="roles must be user or assistant") as info:
        strict.render([{"role": "tool", "content": "x"}])
    assert info.value.status == 400
    assert info.value.param == "messages"


def test_message_the_template_cannot_format_is_invalid_request(template: ChatTemplate) -> None:
    with pytest.raises(InvalidRequestError):
        template.render([{"role": "user", "content": None}])


def test_template_cannot_mutate_the_messages() -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError):
        ChatTemplate("{{ messages.append({'role': 'x'}) }}").render(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_template_cannot_reach_python_internals() -> None:
    with pytest.raises(InvalidRequestError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])


def test_tojson_keeps_markup_and_unicode_unescaped() -> None:
    rendered = ChatTemplate("{{ tools | tojson }}").render([], tools=[{"name": "<a&b>", "d": "日本"}])
    assert rendered == '[{"name": "<a&b>", "d": "日本"}]'


def test_helpers_and_loop_controls_are_available() -> None:
    source = (
        "{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    rendered = ChatTemplate(source).render([{"content": "a"}, {"content": "b"}], add_generation_prompt=False)
    assert rendered == "4a"


def test_template_that_does_not_compile_is_a_model_load_error() -> None:
    with pytest.raises(ModelLoadError):
        ChatTemplate("{% for m in messages %}")


# -- Gemma's turn format, our template for Gemma GGUF files that carry none ------------------------


@pytest.fixture(scope="module")
def gemma_template() -> ChatTemplate:
    source = default_chat_template("gemma3")
    assert source is not None
    return ChatTemplate(source, "<bos>", "<eos>")


def test_gemma_template_folds_the_system_message_into_the_first_user_turn(
    gemma_template: ChatTemplate,
) -> None:
    messages = [{"role": "system", "content": "You are terse."}, *TWO_TURNS]
    assert gemma_template.render(messages) == (
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis.<end_of_turn>\n"
        "<start_of_turn>user\nAnd of Japan? Answer <b>briefly</b> & in 日本語 😀.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    # turn text is trimmed; without a generation prompt the text ends after the last turn
    trimmed = gemma_template.render([{"role": "user", "content": "  hi \n"}], add_generation_prompt=False)
    assert trimmed == "<bos><start_of_turn>user\nhi<end_of_turn>\n"
    # a system message alone is not dropped: it is what the user says
    alone = gemma_template.render([{"role": "system", "content": "Be brief."}])
    assert alone == "<bos><start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.parametrize(
    "roles", [["assistant", "user"], ["user", "user"], ["system", "user", "system"]], ids="-".join
)
def test_gemma_template_refuses_turns_out_of_order(gemma_template: ChatTemplate, roles: list[str]) -> None:
    with pytest.raises(InvalidRequestError, match="alternate user and assistant") as info:
        gemma_template.render([{"role": r, "content": "x"} for r in roles])
    assert info.value.param == "messages"


def test_default_template_is_chosen_by_architecture() -> None:
    assert default_chat_template("gemma3") == default_chat_template("gemma2") is not None
    # no template in the file and none known for its architecture: ChatML, as before
    assert default_chat_template("llama") is None and default_chat_template("") is None
