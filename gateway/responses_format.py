"""Worker outputs → OpenAI Responses API bodies and stream events.

The answer is read by the chat format (`gateway.openai_format.ChatFormat`: content, and tool
calls parsed out of the text), then shaped as a `response`: a `message` output item with one
`output_text` part, and a `function_call` item per call. Streamed, each chat delta becomes
Responses events in their order (`response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta`…
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`, the
function calls' `response.function_call_arguments.delta/.done`, and last
`response.completed`, or `response.incomplete` when `max_output_tokens` cut it short, with the
usage), each with its `sequence_number`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.openai_format import ChatFormat, Header, Sample, Usage
from gateway.responses_api import ResponsesRequest
from rpc import worker_pb2


@dataclass
class ResponsesFormat:
    header: Header
    chat: ChatFormat
    request: ResponsesRequest
    # Streamed: the output items so far, and the events' counter.
    _output: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)
    _open_text: dict[str, Any] | None = field(default=None, init=False, repr=False)
    _finish: str | None = field(default=None, init=False, repr=False)
    _sequence: int = field(default=0, init=False, repr=False)

    def response(self, samples: Sequence[Sample], usage: Usage) -> dict[str, Any]:
        choice = self.chat.response(samples, usage)["choices"][0]
        message = choice["message"]
        output = []
        if message["content"] is not None or not message.get("tool_calls"):
            output.append(_message_item(self._item_id("msg"), message["content"] or ""))
        for call in message.get("tool_calls") or ():
            output.append(_call_item(call))
        return self._body(output, usage, choice["finish_reason"])

    def chunk(
        self,
        message: worker_pb2.GenerateResponse,
        *,
        first: bool,
        text_offset: int,
        include_usage: bool,
    ) -> list[dict[str, Any]] | None:
        events = []
        if self._sequence == 0:
            events += [
                self._event("response.created", response=self._body([], None, None)),
                self._event("response.in_progress", response=self._body([], None, None)),
            ]
        chunk = self.chat.chunk(message, first=first, text_offset=0, include_usage=False)
        if chunk is not None:
            choice = chunk["choices"][0]
            delta = choice["delta"]
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call_events(call)
            self._finish = choice["finish_reason"] or self._finish
        return events or None

    def usage_chunk(self, usage: Usage) -> list[dict[str, Any]]:
        """The stream's closing events: the open text item done, then the whole response."""
        events = self._close_text()
        if not self._output:
            events += self._text_delta("") + self._close_text()
        body = self._body(self._output, usage, self._finish)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=body)]

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open_text is None:
            item = _message_item(self._item_id("msg"), "", status="in_progress")
            self._open_text = item
            self._output.append(item)
            events.append(self._item_event("response.output_item.added", item))
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(self._part_event("response.content_part.added", part=part))
        self._open_text["content"][0]["text"] += text
        if text:
            events.append(self._part_event("response.output_text.delta", delta=text, logprobs=[]))
        return events

    def _close_text(self) -> list[dict[str, Any]]:
        item, self._open_text = self._open_text, None
        if item is None:
            return []
        item["status"] = "completed"
        part = item["content"][0]
        index = self._output.index(item)
        return [
            self._part_event("response.output_text.done", index, text=part["text"], logprobs=[]),
            self._part_event("response.content_part.done", index, part=part),
            self._item_event("response.output_item.done", item),
        ]

    def _call_events(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close_text()
        item = _call_item(call)
        self._output.append(item)
        arguments = item["arguments"]
        common = {"item_id": item["id"], "output_index": len(self._output) - 1}
        added = {**item, "arguments": "", "status": "in_progress"}
        return [
            *events,
            self._event(
                "response.output_item.added", output_index=common["output_index"], item=added
            ),
            self._event("response.function_call_arguments.delta", **common, delta=arguments),
            self._event(
                "response.function_call_arguments.done",
                **common,
                arguments=arguments,
                name=item["name"],
            ),
            self._item_event("response.output_item.done", item),
        ]

    def _item_event(self, kind: str, item: dict[str, Any]) -> dict[str, Any]:
        return self._event(kind, output_index=self._output.index(item), item=item)

    def _part_event(self, kind: str, index: int | None = None, **fields: Any) -> dict[str, Any]:
        assert index is not None or self._open_text is not None
        item = self._open_text if index is None else self._output[index]
        output_index = self._output.index(item) if index is None else index
        return self._event(
            kind, item_id=item["id"], output_index=output_index, content_index=0, **fields
        )

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _item_id(self, kind: str) -> str:
        return f"{kind}_{self.header.id.split('-', 1)[-1]}"

    def _body(
        self, output: list[dict[str, Any]], usage: Usage | None, finish_reason: str | None
    ) -> dict[str, Any]:
        request = self.request
        status = "in_progress" if usage is None else "completed"
        if usage is not None and finish_reason == "length":
            status = "incomplete"
        fmt = request.text.format if request.text is not None else None
        return {
            "id": self.header.id,
            "object": "response",
            "created_at": self.header.created,
            "status": status,
            "model": self.header.model,
            "output": list(output),
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "tools": [t.model_dump(by_alias=True, exclude_none=True) for t in request.tools or ()],
            "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
            "parallel_tool_calls": request.parallel_tool_calls,
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt
                else {"type": "text"}
            },
            "metadata": request.metadata or {},
            "store": False,
            "previous_response_id": None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "usage": None if usage is None else _usage(usage),
        }


def _message_item(item_id: str, text: str, *, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {
        "type": "function_call",
        "id": "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
        "status": "completed",
    }


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
