"""vLLM's `chat_template_kwargs`, bounded to the switches known chat templates read.

vLLM passes any variable a client names to the template; a template is code, so the gateway
takes only named boolean switches whose meaning is known (Qwen3's `enable_thinking`, the
`thinking` of Granite 3.2+ and DeepSeek V3.1), never a variable the rendering itself sets
(`messages`, `tools`, `add_generation_prompt`, the special tokens) nor a value a template
could splice into the prompt. Anything else is a 400 naming `chat_template_kwargs`. A template
that does not read a switch ignores it, as transformers' `apply_chat_template` does.
"""

from __future__ import annotations

from typing import Any

from pydantic import StrictBool, model_validator

from gateway.request_model import RequestModel


class ChatTemplateKwargs(RequestModel):
    """The switches a request may pass to the chat template (each a JSON boolean)."""

    # Qwen3 (and templates that copied it): false closes an empty <think> block at once.
    enable_thinking: StrictBool | None = None
    # Granite 3.2+ and DeepSeek V3.1: true asks for a reasoning section.
    thinking: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_switches_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(str(k) for k in data if k not in cls.model_fields)
            if unknown:
                known = ", ".join(cls.model_fields)
                raise ValueError(
                    f"unknown key {unknown[0][:64]!r}: chat_template_kwargs takes only {known}"
                )
        return data

    def for_template(self) -> dict[str, bool]:
        """The switches a client set, as template variables."""
        return {name: value for name, value in self if value is not None}
