"""A batch's lines: the input file read into requests, each line run through the gateway's one
request pipeline (`gateway.pipeline.answer_line`), and its result recorded with its billing.

Input lines are OpenAI's: `{"custom_id", "method": "POST", "url", "body"}`, `url` the batch's
endpoint, `custom_id` unique in the file. A file that breaks that fails the batch (with each
broken line named in `errors`); a body the endpoint refuses is that line's error only, the
same error the interactive API answers, in the error file.

Recording is one Lua script: the line's output (or error) line is written once, and in the
same atomic step the batch's counts and usage and the tenant's usage counters grow. So a
line is billed exactly once, however often a runner dies around it: a line whose result is
recorded is never run again, and one that is not was never billed.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from pydantic import BaseModel, ValidationError

from gateway.errors import GatewayError, InvalidRequestError, error_body, gateway_error_body
from gateway.parsing import OpenAIRequest
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.responses_api import ResponsesRequest
from gateway.tenancy.quotas import USAGE_TTL_S, utc_day
from gateway.tenancy.usage import UsageDelta, usage_key

BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
}
MAX_CUSTOM_ID_CHARS = 512
MAX_FILE_ERRORS = 100  # lines named in a failed batch's `errors`


class Kind:
    """What a recorded line is: in the output file, the error file, or neither (a line that
    was running when its batch was cancelled: billed for what it generated, in no file)."""

    OUTPUT = "o"
    ERROR = "e"
    CANCELLED = "c"


@dataclass(frozen=True, slots=True)
class InputLine:
    index: int  # 0-based line of the file
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LineError:
    """A broken input line, as OpenAI's `BatchError`."""

    line: int  # 1-based
    code: str
    message: str
    param: str | None = None

    def to_openai(self) -> dict[str, Any]:
        return {"code": self.code, "line": self.line, "message": self.message, "param": self.param}


def read_input(data: bytes, *, endpoint: str, max_lines: int) -> list[InputLine] | list[LineError]:
    """The file's lines, or what is wrong with it (each broken line, up to a bound)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return [LineError(1, "invalid_json_line", "the file is not UTF-8 text")]
    lines: list[InputLine] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    raw_lines = [raw for raw in text.split("\n")]
    if raw_lines and not raw_lines[-1].strip():
        raw_lines.pop()
    if not raw_lines:
        return [LineError(1, "empty_file", "the file holds no requests")]
    if len(raw_lines) > max_lines:
        return [LineError(max_lines + 1, "too_many_lines", f"at most {max_lines} requests")]
    for index, raw in enumerate(raw_lines):
        found = _read_line(raw, index, endpoint=endpoint, seen=seen)
        if isinstance(found, LineError):
            errors.append(found)
            if len(errors) == MAX_FILE_ERRORS:
                break
        else:
            lines.append(found)
    return errors or lines


def _read_line(raw: str, index: int, *, endpoint: str, seen: set[str]) -> InputLine | LineError:
    number = index + 1
    try:
        item = json.loads(raw)
    except ValueError:
        return LineError(number, "invalid_json_line", "This line is not parseable as valid JSON.")
    if not isinstance(item, dict):
        return LineError(number, "invalid_json_line", "This line is not a JSON object.")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return LineError(
            number, "invalid_request", "custom_id must be a non-empty string", "custom_id"
        )
    if custom_id in seen:
        return LineError(
            number, "duplicate_custom_id", f"custom_id {custom_id!r} is used twice", "custom_id"
        )
    seen.add(custom_id)
    if item.get("method") != "POST":
        return LineError(number, "invalid_method", "method must be POST", "method")
    if item.get("url") != endpoint:
        return LineError(
            number, "mismatched_url", f"url must be the batch's endpoint, {endpoint}", "url"
        )
    body = item.get("body")
    if not isinstance(body, dict):
        return LineError(number, "invalid_request", "body must be a JSON object", "body")
    return InputLine(index, custom_id, body)


def request_of(line: InputLine, endpoint: str) -> OpenAIRequest:
    """The line's body as the endpoint's request model: its schema errors as the interactive
    API's 400 (`invalid_value`, naming the field)."""
    if line.body.get("stream"):
        raise InvalidRequestError("stream is not supported in a batch", param="stream")
    try:
        return BODIES[endpoint].model_validate(line.body)  # type: ignore[return-value]
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())) or 'body'}: {e['msg']}"
            for e in exc.errors()
        )
        error = InvalidRequestError(message, param=param)
        error.code = "invalid_value"
        raise error from None


def output_line(line: InputLine, *, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": _line_id(),
        "custom_id": line.custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(line: InputLine, *, request_id: str, error: GatewayError) -> dict[str, Any]:
    """A request the pipeline refused: its status and error body, as the API answers it."""
    return {
        "id": _line_id(),
        "custom_id": line.custom_id,
        "response": {
            "status_code": error.status,
            "request_id": request_id,
            "body": gateway_error_body(error),
        },
        "error": None,
    }


def expired_line(line: InputLine) -> dict[str, Any]:
    return {
        "id": _line_id(),
        "custom_id": line.custom_id,
        "response": None,
        "error": error_body(
            "This request could not be executed before the completion window expired.",
            type="batch_error",
            code="batch_expired",
        )["error"],
    }


def _line_id() -> str:
    return "batch_req_" + secrets.token_hex(12)


# KEYS: 1 the batch's lines, 2 the batch, 3 the tenant's usage today;
# ARGV: 1 line index, 2 kind, 3 the line (JSON), 4 prompt, 5 completion, 6 cached tokens,
# 7 usage TTL, 8.. usage field/amount pairs.
# Returns 1 when recorded, 0 when the line was recorded already (nothing changes), -1 when
# the batch no longer takes lines (final).
RECORD = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
local status = redis.call('HGET', KEYS[2], 'status')
if status ~= 'in_progress' and status ~= 'cancelling' then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ARGV[3])
if ARGV[2] == 'o' then redis.call('HINCRBY', KEYS[2], 'completed', 1) end
if ARGV[2] == 'e' then redis.call('HINCRBY', KEYS[2], 'failed', 1) end
redis.call('HINCRBY', KEYS[2], 'input_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[2], 'output_tokens', ARGV[5])
redis.call('HINCRBY', KEYS[2], 'cached_tokens', ARGV[6])
for i = 8, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[3], ARGV[i], ARGV[i + 1])
end
if #ARGV >= 8 then redis.call('EXPIRE', KEYS[3], tonumber(ARGV[7])) end
return 1
"""


class LineRecorder:
    """Writes lines' results with their billing (the `RECORD` script)."""

    def __init__(self, redis: aioredis.Redis, *, prefix: str) -> None:
        self.prefix = prefix
        self._script = redis.register_script(RECORD)

    async def record(
        self,
        *,
        tenant: str,
        lines_key: str,
        batch_key: str,
        index: int,
        kind: str,
        line: dict[str, Any] | None,
        usage: UsageDelta | None,
    ) -> int:
        usage = usage or UsageDelta(model="", requests=0)
        increments = usage.increments() if usage.model else []
        args = [
            index,
            kind,
            json.dumps(line, separators=(",", ":")) if line is not None else "",
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_tokens,
            USAGE_TTL_S,
            *increments,
        ]
        keys = [lines_key, batch_key, usage_key(self.prefix, tenant, utc_day())]
        return int(await self._script(keys=keys, args=args))


def recorded_line(value: str) -> tuple[str, dict[str, Any] | None]:
    """(kind, line) of a stored result."""
    kind, text = stored_text(value)
    return kind, (json.loads(text) if text else None)


def stored_text(value: str) -> tuple[str, str]:
    """(kind, the line's JSON text, "" for none) of a stored result."""
    return value[:1], value[1:]
