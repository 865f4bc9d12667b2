"""A lean HTTP/1.1 load generator for request-rate benchmarks.

By hand, not httpx: on these 2 cores httpx's connection pool costs more CPU per request
than the gateway under test, so a benchmark driven by it would mostly measure itself.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass


def post_request(path: str, body: dict, *, key: str) -> bytes:
    """The bytes of one keep-alive POST of `body` as JSON, with a bearer key."""
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


async def keep_alive_client(
    port: int, request: bytes, *, deadline: float, counts: dict[int, int]
) -> None:
    """Send `request` over one keep-alive connection until `deadline`, counting statuses
    (responses must carry a Content-Length: JSON bodies, not streams)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < deadline:
            writer.write(request)
            status = int((await reader.readline()).split()[1])
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            counts[status] = counts.get(status, 0) + 1
    finally:
        writer.close()


@dataclass
class EventStream:
    stamps: list[float]  # when each SSE event that carries a choice arrived
    overhead_ms: float | None  # the gateway's own time, from x-switchboard-overhead-ms


async def stream_events(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> EventStream:
    """Send one streaming request on a keep-alive connection and read its events (OpenAI's
    chunked ``text/event-stream``) to the end."""
    writer.write(request)
    status = int((await reader.readline()).split()[1])
    chunked = False
    overhead_ms = None
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"x-switchboard-overhead-ms":
            overhead_ms = float(value)
    if status != 200 or not chunked:
        raise RuntimeError(f"expected a 200 event stream, got {status}")
    stamps: list[float] = []
    pending = b""
    while size := int((await reader.readline()).strip(), 16):
        pending += (await reader.readexactly(size + 2))[:-2]
        now = time.monotonic()
        *events, pending = pending.split(b"\n\n")
        stamps.extend(now for e in events if e.startswith(b"data: {") and b'"choices":[{' in e)
    await reader.readexactly(2)  # the last chunk's CRLF
    return EventStream(stamps, overhead_ms)


async def hammer(
    port: int, request: bytes, *, concurrency: int, seconds: float
) -> tuple[dict[int, int], float]:
    """`concurrency` keep-alive clients sending `request` for `seconds`: (statuses, elapsed)."""
    counts: dict[int, int] = {}
    deadline = time.monotonic() + seconds
    start = time.monotonic()
    await asyncio.gather(
        *(
            keep_alive_client(port, request, deadline=deadline, counts=counts)
            for _ in range(concurrency)
        )
    )
    return counts, time.monotonic() - start
