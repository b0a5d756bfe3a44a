"""Chat messages to a prompt string.

With a Jinja chat template from the model directory (`EngineClient.chat_template`), the
template is rendered in a sandboxed Jinja environment with `messages` and
`add_generation_prompt=True` (plus `bos_token` / `eos_token` when known), as Hugging Face
chat templates expect. Without one, the default format is::

    <|system|>
    You are terse.
    <|user|>
    Hi!
    <|assistant|>

that is, every message as `<|role|>\\n{content}\\n`, then `<|assistant|>\\n` for the reply.
With `tools`, a `<|tools|>` block comes first: the tools as JSON, one a line, and how to call
them, in the Hermes format Qwen-family templates use (`<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`, which `tandem.serving.openai.tool_parser` reads back). An assistant message's
`tool_calls` are written in that format after its content; a `tool` message is `<|tool|>`.

Message content is a string, null (empty) or a list of `{"type": "text", "text": ...}` parts,
joined with newlines; any other part type is refused with `ChatTemplateError` (a 400).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Mapping, Sequence

from tandem.serving.openai.protocol import invalid_request
from tandem.serving.openai.tool_parser import TOOL_CALL_START


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad content part, or the template refused them)."""


def message_text(content: Any, where: str = "content") -> str:
    """A message's content as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ChatTemplateError(f"'{where}' must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"'{where}[{i}]' must be an object like {{\"type\": \"text\", \"text\": ...}}")
        kind = part.get("type")
        if kind != "text":
            raise ChatTemplateError(
                f"'{where}[{i}]' has type {kind!r}: only 'text' content parts are supported by this server"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"'{where}[{i}].text' must be a string")
        extra = set(part) - {"type", "text"}
        if extra:
            raise ChatTemplateError(f"'{where}[{i}]' has unknown field(s): {', '.join(sorted(extra))}")
        texts.append(text)
    return "\n".join(texts)


def _decoded_arguments(call: Any) -> Any:
    """An assistant tool call with its `function.arguments` JSON text decoded into an object,
    as vLLM hands them to templates (Qwen's writes them with `tojson`)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as plain dicts with string content and decoded tool-call arguments (what chat
    templates expect)."""
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"'messages[{i}].role' must be a non-empty string")
        item = {k: v for k, v in message.items() if v is not None}
        item["content"] = message_text(message.get("content"), where=f"messages[{i}].content")
        if isinstance(item.get("tool_calls"), list):
            item["tool_calls"] = [_decoded_arguments(c) for c in item["tool_calls"]]
        out.append(item)
    return out


TOOLS_PREAMBLE = (
    "You may call one or more of these functions. To call one, reply with "
    '<tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>'
)


def _tool_call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function") or {}
    body = json.dumps({"name": function.get("name"), "arguments": function.get("arguments", {})}, ensure_ascii=False)
    return f"<tool_call>{body}</tool_call>"


def default_chat_prompt(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> str:
    parts = []
    if tools:
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        parts.append(f"<|tools|>\n{TOOLS_PREAMBLE}\n{lines}\n")
    for m in messages:
        content = m["content"]
        calls = [_tool_call_text(c) for c in m.get("tool_calls") or []]
        if calls:
            content = "\n".join(([content] if content else []) + calls)
        parts.append(f"<|{m['role']}|>\n{content}\n")
    return "".join(parts) + "<|assistant|>\n"


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(str(message))


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    # Jinja's own `tojson` HTML-escapes; chat templates want plain JSON.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def compile_template(template: str):
    """A compiled Jinja template in a sandboxed environment (cached per template text).
    Raises `jinja2.TemplateSyntaxError` for a broken template."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # pragma: no cover - jinja2 is a dependency
        raise RuntimeError("rendering a model's chat template needs jinja2: pip install jinja2") from exc

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], autoescape=False
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(messages: Sequence[Mapping[str, Any]], template: str | None, **context: Any) -> str:
    """The prompt for `messages`: `template` (Jinja) rendered with `add_generation_prompt`
    (default True) and `context` (e.g. `bos_token`, `eos_token`, `tools`, a request's
    `chat_template_kwargs`), or the default format when `template` is None. Raises `ChatTemplateError` for content it cannot render."""
    if not messages:
        raise ChatTemplateError("'messages' must contain at least one message")
    normalized = normalize_messages(messages)
    add_generation_prompt = bool(context.pop("add_generation_prompt", True))
    if template is None:
        prompt = default_chat_prompt(normalized, context.get("tools"))
        return prompt if add_generation_prompt else prompt.removesuffix("<|assistant|>\n")
    from jinja2 import TemplateError

    compiled = compile_template(template)
    try:
        return compiled.render(messages=normalized, add_generation_prompt=add_generation_prompt, **context)
    except ChatTemplateError:
        raise
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template cannot render these messages: {exc}") from None


class ChatFormat:
    """The served model's chat format: its template (None: the default format) and the
    `bos_token`/`eos_token` it is rendered with, shared by chat completions and `/tokenize`."""

    def __init__(self, client: Any) -> None:
        self.template: str | None = getattr(client, "chat_template", None)
        if self.template is not None:
            try:
                compile_template(self.template)
            except Exception as exc:
                raise ValueError(f"the model's chat template does not compile: {exc}") from exc
        self.context = _special_tokens(client)

    @property
    def writes_special_tokens(self) -> bool:
        """A model's template writes its special tokens itself; the default format does not."""
        return self.template is not None

    @property
    def parses_tool_calls(self) -> bool:
        """Whether "auto" replies are read for tool calls: the format writes them in the Hermes
        format (this server's default format, Qwen-family templates)."""
        return self.template is None or TOOL_CALL_START in self.template

    def render(self, messages: list[dict[str, Any]], req: Any) -> str:
        """`messages` as a prompt, with the request's `tools`, `chat_template_kwargs` and
        `add_generation_prompt`."""
        context: dict[str, Any] = dict(self.context)
        if req.tools is not None:
            context["tools"] = req.tools
        kwargs = req.chat_template_kwargs or {}
        reserved = sorted({"messages", "template"} & set(kwargs))
        if reserved:
            raise invalid_request(f"'chat_template_kwargs' may not set {reserved[0]!r}", param="chat_template_kwargs")
        context.update(kwargs)
        if req.add_generation_prompt is not None:
            context["add_generation_prompt"] = req.add_generation_prompt
        return render_chat(messages, self.template, **context)


def _special_tokens(client: Any) -> dict[str, str]:
    """`bos_token`/`eos_token` for chat templates: from the client when it has them, else the
    eos token's text from the tokenizer."""
    context = {"bos_token": getattr(client, "bos_token", None) or "", "eos_token": ""}
    eos = getattr(client, "eos_token", None)
    if not eos and client.eos_token_ids:
        try:
            eos = client.tokenizer.id_to_token(min(client.eos_token_ids))
        except Exception:
            eos = None
    context["eos_token"] = eos or ""
    return context
