"""Chat templates render as transformers renders them (the same token ids), the
built-in template serves the presets, and bad messages get a 400 naming them."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from support.tokenizer import make_tokenizer
from vertumnus.protocol.chat import ChatTemplate, check_messages
from vertumnus.protocol.errors import BadRequest
from vertumnus.protocol.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hello, world!"}],
    [
        {"role": "system", "content": "You compute prefills."},
        {"role": "user", "content": "How are you today?"},
        {"role": "assistant", "content": "I am fine, thank you."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Ünïcödé"}, {"type": "text", "text": "text"}],
        },
    ],
]


@pytest.mark.parametrize("generation", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_token_ids_equal_transformers(tmp_path: Path, messages: list, generation: bool) -> None:
    make_tokenizer(tmp_path, 512)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    # transformers joins text parts as vLLM does only when given strings: give it those.
    plain = [
        {
            **m,
            "content": m["content"]
            if isinstance(m["content"], str)
            else "\n".join(p["text"] for p in m["content"]),
        }
        for m in messages
    ]
    want = hf.apply_chat_template(plain, add_generation_prompt=generation, tokenize=True)
    if isinstance(want, dict) or hasattr(want, "input_ids"):
        want = want["input_ids"]
    ours = Tokenizer.for_model(str(tmp_path), 512)
    assert ours.chat is not None and ours.chat.origin.endswith("chat_template.jinja")
    text = ours.chat.render(check_messages(messages), add_generation_prompt=generation)
    assert ours.encode(text, add_special_tokens=False) == list(want)


def test_next_turn_starts_with_the_last_turns_tokens(tmp_path: Path) -> None:
    """The rendered history is a prefix of the next turn's prompt: the cache reuses it."""
    make_tokenizer(tmp_path, 512)
    tok = Tokenizer.for_model(str(tmp_path), 512)
    assert tok.chat is not None
    first = [{"role": "user", "content": "Hello, world!"}]
    turn1 = tok.encode(tok.chat.render(check_messages(first)), False)
    second = [
        *first,
        {"role": "assistant", "content": "I am fine."},
        {"role": "user", "content": "Thank you."},
    ]
    turn2 = tok.encode(tok.chat.render(check_messages(second)), False)
    assert turn2[: len(turn1)] == turn1 and len(turn2) > len(turn1)


def test_builtin_template_for_presets() -> None:
    tok = Tokenizer.for_model(None, 1024)
    assert tok.chat is not None
    text = tok.chat.render(check_messages([{"role": "user", "content": "hi"}]))
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(text) == list(text.encode())


def test_template_from_tokenizer_config_and_named_list(tmp_path: Path) -> None:
    make_tokenizer(tmp_path, 512)
    (tmp_path / "chat_template.jinja").unlink()
    import json

    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ eos_token }}{{ messages[0]['content'] }}"},
    ]
    config_path.write_text(json.dumps(config))
    chat = ChatTemplate.for_folder(str(tmp_path))
    assert chat.render(check_messages([{"role": "user", "content": "x"}])) == "<|im_end|>x"


def test_continue_final_message() -> None:
    chat = ChatTemplate.for_folder(None)
    messages = check_messages(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    )
    text = chat.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nOnce upon")


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        ([{"role": "robot", "content": "x"}], "role"),
        ([{"role": "user"}], "content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "only text parts",
        ),
        ([{"role": "assistant", "content": None, "tool_calls": []}], "tool_calls"),
    ],
)
def test_bad_messages_are_refused(messages: object, says: str) -> None:
    with pytest.raises(BadRequest, match=says) as info:
        check_messages(messages)
    assert info.value.param == "messages"


def test_template_errors_are_a_400() -> None:
    chat = ChatTemplate("{{ raise_exception('no system messages') }}", {}, "test")
    with pytest.raises(BadRequest, match="no system messages"):
        chat.render(check_messages([{"role": "user", "content": "x"}]))
