"""Large JSON answers, built and serialized without holding the event loop.

A non-streamed answer may hold a million logprob entries (echo with 20 alternatives in each
of 60 choices: ~13 MB of JSON). Built on a thread it still holds the GIL: pure Python gives
it up every switch interval, but one ``json.dumps`` of the whole body is a single C call
(~0.3 s for 15 MB), and every such call from 16 answers at once stalls every stream. So a
large body is assembled on one thread of its own (the GIL lets one thread run Python at a
time anyway, and the loop then waits for at most that one at each hand-off; large answers
queue for it, small ones never do) and serialized in pieces, each a ``json.dumps`` of at
most ``SLICE`` list items, then sent in ``CHUNK_BYTES`` chunks that yield to the loop between
them. The bytes are those ``JSONResponse`` would send.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi.responses import StreamingResponse

SLICE = 256  # list items per json.dumps call (a few thousand entries with their alternatives)
CHUNK_BYTES = 64 << 10  # bytes per send to the client
LARGE_ANSWER_THREADS = 1
# Threads for large answers only; made on first use (ThreadPoolExecutor starts none before).
_POOL = ThreadPoolExecutor(max_workers=LARGE_ANSWER_THREADS, thread_name_prefix="large-answer")


def _dumps(value: Any) -> bytes:
    # JSONResponse's options, so the bytes are the same as its render.
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def json_pieces(value: Any, out: list[bytes]) -> None:
    """Append ``value``'s JSON to ``out`` in pieces: a dict key by key, a list of containers
    item by item, a long list ``SLICE`` items a call, anything else in one call."""
    if isinstance(value, dict):
        out.append(b"{")
        for i, (key, item) in enumerate(value.items()):
            out.append((b"," if i else b"") + _dumps(str(key)) + b":")
            json_pieces(item, out)
        out.append(b"}")
    elif isinstance(value, list) and len(value) > SLICE:
        out.append(b"[")
        for start in range(0, len(value), SLICE):
            out.append((b"," if start else b"") + _dumps(value[start : start + SLICE])[1:-1])
        out.append(b"]")
    elif isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        out.append(b"[")
        for i, item in enumerate(value):
            if i:
                out.append(b",")
            json_pieces(item, out)
        out.append(b"]")
    else:
        out.append(_dumps(value))


def chunks_of(value: Any) -> list[bytes]:
    """``value`` as JSON, in chunks of about ``CHUNK_BYTES``."""
    pieces: list[bytes] = []
    json_pieces(value, pieces)
    chunks, pending, size = [], [], 0
    for piece in pieces:
        pending.append(piece)
        size += len(piece)
        if size >= CHUNK_BYTES:
            chunks.append(b"".join(pending))
            pending, size = [], 0
    if pending:
        chunks.append(b"".join(pending))
    return chunks


async def large_json_response(build: Callable[[], Any]) -> StreamingResponse:
    """``build()``'s JSON answer: built and cut into chunks on the large-answer threads, then
    sent chunk by chunk, yielding to the loop after each."""
    chunks = await asyncio.get_running_loop().run_in_executor(_POOL, lambda: chunks_of(build()))

    async def body() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk
            await asyncio.sleep(0)

    length = sum(len(c) for c in chunks)
    return StreamingResponse(
        body(), media_type="application/json", headers={"content-length": str(length)}
    )
