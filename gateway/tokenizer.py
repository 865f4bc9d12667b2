"""The gateway's tokenizer and chat template, without transformers.

Why not `transformers.AutoTokenizer`: importing it pulls in torch (checked with transformers
5.24 on the default model: `'torch' in sys.modules` is True after `from_pretrained`), and the
gateway must stay light. So we load `tokenizer.json` with the `tokenizers` library (the same
Rust tokenizer transformers wraps) and render the chat template with a sandboxed jinja2
environment configured the way transformers configures it (`trim_blocks`, `lstrip_blocks`,
`loopcontrols`, `raise_exception`, `tojson`, the special tokens as variables). A test checks
the rendering against transformers' `apply_chat_template`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway.errors import InvalidRequestError

SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerFilesError(RuntimeError):
    """The checkpoint directory lacks a usable tokenizer.json (the gateway cannot start)."""


@dataclass(frozen=True)
class ChatTokenizer:
    """Encode prompts, render chat templates, name tokens (for logprobs)."""

    tokenizer: Tokenizer
    chat_template: jinja2.Template | None
    special_tokens: Mapping[str, str]

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerFilesError(f"{file} is missing: the gateway needs the fast tokenizer")
        config = _read_json(path / "tokenizer_config.json")
        special = {
            field: _token_content(config[field])
            for field in SPECIAL_TOKEN_FIELDS
            if config.get(field) is not None
        }
        source = _chat_template_source(path, config)
        template = _compile(source) if source is not None else None
        return cls(Tokenizer.from_file(str(file)), template, special)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of a conversation, as `apply_chat_template(tokenize=False)` gives."""
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions", param="messages"
            )
        try:
            return self.chat_template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            # Templates reject conversations they cannot format (raise_exception).
            raise InvalidRequestError(f"chat template: {exc}", param="messages") from exc

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        # The template writes the special tokens itself, so none are added (like transformers).
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (what vLLM shows: the token decoded on its own)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _token_content(value: Any) -> str:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    return value["content"] if isinstance(value, dict) else str(value)


def _chat_template_source(path: Path, config: Mapping[str, Any]) -> str | None:
    """transformers' lookup order: chat_template.jinja, then tokenizer_config's field."""
    file = path / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
