"""Render a chat to a prompt with the checkpoint's own chat template, as transformers does.

The template is the checkpoint's (HF convention): `chat_template.jinja` in the directory, else
`chat_template` in tokenizer_config.json (a string, or HF's list of named templates, whose "default"
is used). It renders as transformers' `apply_chat_template` renders it, so the prompt is the one the
model was trained on: a jinja2 ImmutableSandboxedEnvironment (hub templates are untrusted code) with
trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `tojson` and `strftime_now`, and
`messages`, `add_generation_prompt`, `bos_token`, `eos_token` in scope (an absent token is undefined,
so it renders empty, as in transformers).

The rendered prompt already holds the template's special tokens: tokenize it without adding any.
Every failure is a ValueError in one line (the HTTP layer answers 400).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplateError(ValueError):
    """The template is unreadable, does not compile, refused the messages or failed to render."""


class NoChatTemplate(ChatTemplateError):
    """The checkpoint has no chat template: only /v1/completions can serve it."""


class _TemplateRefusal(jinja2.TemplateError):
    """What `raise_exception` raises: the template's own verdict on the messages."""


def _raise_exception(message: str):
    raise _TemplateRefusal(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: jinja's own escapes HTML characters, which a prompt must not see
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers marks the assistant's
    tokens with it for training masks; without the tag such templates would not compile)."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


@dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's compiled chat template and the special tokens it may print."""

    name: str  # the checkpoint directory's name, for messages
    source: str
    bos_token: str | None
    eos_token: str | None
    template: jinja2.Template

    def render(self, messages: Iterable[Mapping[str, str]], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """The prompt for `messages` (dicts or models with role and content), and `tools` (OpenAI's
        tool definitions, for a template that renders them; None: none in scope, as transformers);
        ChatTemplateError on a refusal (the template's `raise_exception`) or any other failure."""
        tokens = {key: value for key, value in (("bos_token", self.bos_token), ("eos_token", self.eos_token))
                  if value is not None}
        if tools is not None:
            tokens["tools"] = tools
        chat = [dict(message) for message in messages]
        try:
            prompt = self.template.render(messages=chat, add_generation_prompt=add_generation_prompt,
                                          **tokens)
        except _TemplateRefusal as error:
            raise ChatTemplateError(f"the chat template refused the messages: {_one_line(error)}") from None
        except Exception as error:  # a template is code: any exception is its failure, not ours
            raise ChatTemplateError(f"{self.name}: the chat template failed to render "
                                    f"({type(error).__name__}: {_one_line(error)})") from None
        dropped = [message for message in chat if message.get("role") == "tool" and message.get("content")
                   and message["content"] not in prompt]
        if dropped:  # a template that skips roles it does not know would lose the tool's answer silently
            raise ChatTemplateError(f"{self.name}: the chat template does not render tool messages (the "
                                    "content of one is not in the prompt it made)")
        return prompt


def load_chat_template(directory: str | Path) -> ChatTemplate:
    """The checkpoint's template, compiled once per directory (a later edit of the files is not seen)."""
    return _load(Path(directory).resolve())


@lru_cache(maxsize=16)
def _load(directory: Path) -> ChatTemplate:
    config = _tokenizer_config(directory)
    source = _template_source(directory, config)
    try:
        template = _environment().from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"{directory.name}: the chat template does not compile: "
                                f"{_one_line(error.message or error)} (line {error.lineno})") from None
    return ChatTemplate(directory.name, source, _token(config, "bos_token"), _token(config, "eos_token"),
                        template)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env


def _tokenizer_config(directory: Path) -> dict | None:
    file = directory / TOKENIZER_CONFIG
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ChatTemplateError(f"{directory.name}/{TOKENIZER_CONFIG}: not readable JSON ({_one_line(error)})"
                                ) from None
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{directory.name}/{TOKENIZER_CONFIG}: not a JSON object")
    return config


def _template_source(directory: Path, config: dict | None) -> str:
    """chat_template.jinja wins over tokenizer_config.json's chat_template (transformers' order)."""
    file = directory / TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    where = f"{TOKENIZER_CONFIG} has no chat_template" if config is not None else f"no {TOKENIZER_CONFIG}"
    template = (config or {}).get("chat_template")
    if isinstance(template, list):  # HF's named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
        where = f"{TOKENIZER_CONFIG} has named chat templates but none named 'default'"
    if template is None:
        raise NoChatTemplate(f"{directory.name}: no chat template ({where}); use /v1/completions")
    if not isinstance(template, str):
        raise ChatTemplateError(f"{directory.name}/{TOKENIZER_CONFIG}: chat_template is not a string")
    return template


def _token(config: dict | None, key: str) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    value = (config or {}).get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
