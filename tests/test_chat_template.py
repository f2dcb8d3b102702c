"""Chat templates render as HF transformers renders them, inside a sandbox."""

from pathlib import Path
from typing import Any

import pytest

from rocforge_rt.model.chat import render_chat
from rocforge_rt.model.gguf_metadata import read_metadata
from rocforge_rt.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def metadata(source_gguf: Path) -> dict[str, Any]:
    return read_metadata(source_gguf)


@pytest.fixture(scope="module")
def template(metadata: dict[str, Any]) -> str:
    return metadata["tokenizer.chat_template"]


def test_user_message_with_generation_prompt_ends_with_assistant_header(template: str) -> None:
    prompt = render_chat(template, [{"role": "user", "content": "Name a color."}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_system_message_replaces_the_default_system_prompt(template: str) -> None:
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
    ]
    prompt = render_chat(template, messages)
    assert prompt.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n")
    assert "SmolLM" not in prompt


def test_without_generation_prompt_the_prompt_ends_after_the_last_message(template: str) -> None:
    prompt = render_chat(template, [{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n")


def test_blocks_are_trimmed_as_in_transformers() -> None:
    template = (
        "{% for m in messages %}\n  {% if m.role %}\n[{{ m.content }}]\n  {% endif %}\n{% endfor %}"
    )
    assert render_chat(template, [{"role": "user", "content": "a"}]) == "[a]\n"


def test_bos_and_eos_tokens_and_loop_controls_are_available() -> None:
    template = "{{ bos_token }}{% for m in messages %}{% break %}{% endfor %}{{ eos_token }}"
    assert render_chat(template, [], bos_token="<s>", eos_token="</s>") == "<s></s>"


def test_tojson_keeps_key_order_and_non_ascii_text() -> None:
    rendered = render_chat("{{ messages[0] | tojson }}", [{"role": "user", "content": "é"}])
    assert rendered == '{"role": "user", "content": "é"}'


def test_raise_exception_in_a_template_raises_value_error() -> None:
    with pytest.raises(ValueError, match="roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", [])


def test_template_with_a_syntax_error_raises_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match="not valid Jinja"):
        render_chat("{% for m in messages %}", [])


def test_template_failing_while_rendering_raises_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match="failed to render"):
        render_chat("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}])


def test_sandbox_forbids_mutating_the_messages() -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match="failed to render"):
        render_chat("{{ messages.append({}) }}", messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_tokenizer_renders_with_the_gguf_template(metadata: dict[str, Any]) -> None:
    tokenizer = Tokenizer.from_metadata(metadata)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_without_a_template_raises_value_error(metadata: dict[str, Any]) -> None:
    tokenizer = Tokenizer.from_metadata({**metadata, "tokenizer.chat_template": None})
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no 'tokenizer.chat_template'"):
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
