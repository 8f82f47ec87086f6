"""Chat messages to prompt text, as ``transformers`` renders them.

The template is the model folder's (``chat_template.jinja``, else ``chat_template``
in ``chat_template.json`` or ``tokenizer_config.json``; a list of named templates
uses the one named "default"), or, for the presets and folders without one, the
built-in ChatML template below. It renders in jinja2's immutable sandbox with
transformers' settings: ``trim_blocks``, ``lstrip_blocks``, loop controls, a
``tojson`` that keeps non-ASCII text, ``raise_exception``, ``strftime_now``, the
``{% generation %}`` tag, and the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as variables. The rendered text is tokenized without adding
special tokens (the template wrote them), so a conversation's next turn starts with
the same tokens as its last: the prefix cache serves the history.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from jinja2 import nodes

from vertumnus.protocol.errors import BadRequest

BUILTIN = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROLES = ("system", "developer", "user", "assistant", "tool")
_SPECIAL = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers uses
    it to mark the assistant's tokens)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's interface)

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _token(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: text or {"content": text}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """One chat template, compiled; ``origin`` says where it came from."""

    def __init__(self, source: str, special: dict[str, str], origin: str) -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_Generation, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template of {origin} does not compile: {exc}") from exc
        self.special, self.origin = special, origin

    @classmethod
    def for_folder(cls, model_dir: str | None) -> ChatTemplate:
        """The folder's template, or the built-in one; ``ValueError`` for a template
        that does not compile."""
        if model_dir is None:
            return cls(BUILTIN, {}, "the built-in ChatML template")
        folder = Path(model_dir)
        config: dict[str, Any] = {}
        path = folder / "tokenizer_config.json"
        if path.is_file():
            config = json.loads(path.read_text())
        special = {name: tok for name in _SPECIAL if (tok := _token(config.get(name)))}
        source: Any = config.get("chat_template")
        origin = str(path)
        if (folder / "chat_template.json").is_file():
            source = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
            origin = str(folder / "chat_template.json")
        if (folder / "chat_template.jinja").is_file():
            source, origin = (
                (folder / "chat_template.jinja").read_text(),
                str(folder / "chat_template.jinja"),
            )
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            return cls(BUILTIN, special, "the built-in ChatML template")
        return cls(source, special, origin)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text of ``messages`` (checked by ``check_messages``)."""
        try:
            text = self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special,
                **(kwargs or {}),
            )
        except jinja2.TemplateError as exc:
            raise BadRequest(f"the chat template refused the messages: {exc}", "messages") from None
        if continue_final_message:
            final = str(messages[-1]["content"]).strip()
            at = text.rfind(final)
            if at < 0:
                raise BadRequest(
                    "the chat template does not render the final message's text as given: "
                    "it cannot be continued",
                    "continue_final_message",
                )
            text = text[: at + len(final)]
        return text


def _content(message: dict[str, Any], i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # parts: text only, joined by newlines (as vLLM)
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(
                    f"'messages[{i}].content[{j}]': only text parts are supported "
                    f"(type 'text'), got {kind!r}",
                    "messages",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    if content is None and message.get("role") == "assistant":
        return ""
    raise BadRequest(f"'messages[{i}].content' must be a string or a list of parts", "messages")


def check_messages(raw: Any) -> list[dict[str, Any]]:
    """The ``messages`` of a chat request, each as the template sees it: ``role``,
    ``content`` as text, and ``name`` where given."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise BadRequest(f"'messages[{i}]' must be an object", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(f"'messages[{i}].role' must be one of {list(ROLES)}", "messages")
        unknown = sorted(set(message) - {"role", "content", "name", "tool_call_id"})
        if unknown:
            raise BadRequest(
                f"'messages[{i}]': {unknown} not supported (no tool calls on this server)",
                "messages",
            )
        entry = {"role": role, "content": _content(message, i)}
        for key in ("name", "tool_call_id"):
            if key in message:
                if not isinstance(message[key], str):
                    raise BadRequest(f"'messages[{i}].{key}' must be a string", "messages")
                entry[key] = message[key]
        out.append(entry)
    return out
