"""`/v1/files` and `/v1/batches`, thin: the logic is in `gateway.batch.files`, `batches` and
the runner. Another tenant's file or batch answers exactly as a missing one (404)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import Field
from starlette.datastructures import FormData, UploadFile

from gateway.batch.batches import BatchRef
from gateway.batch.files import check_purpose
from gateway.deps import CurrentTenant, State
from gateway.errors import InvalidRequestError, PayloadTooLargeError
from gateway.request_model import RequestModel
from gateway.uploads.staging import bounded

router = APIRouter(prefix="/v1")
MAX_FORM_PARTS = 8
MAX_TEXT_FIELD_BYTES = 4096
MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 30 * 86400


class ExpiresAfter(RequestModel):
    """OpenAI's expiration policy: seconds after the file's creation, 1 hour to 30 days."""

    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(ge=MIN_EXPIRES_AFTER_S, le=MAX_EXPIRES_AFTER_S)]


class CreateBatch(RequestModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Any] | None = None
    output_expires_after: ExpiresAfter | None = None  # the output and error files'


@router.post("/files")
async def create_file(request: Request, caller: CurrentTenant, state: State) -> dict[str, Any]:
    """Multipart, as the SDK's `files.create` sends it: `file`, `purpose`, and optionally
    `expires_after[anchor]=created_at` with `expires_after[seconds]`."""
    limit = state.settings.max_batch_file_bytes
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise InvalidRequestError("upload the file as multipart/form-data", param="file")
    form = await bounded(request, limit + (64 << 10)).form(
        max_files=MAX_FORM_PARTS, max_fields=MAX_FORM_PARTS, max_part_size=MAX_TEXT_FIELD_BYTES
    )
    try:
        purpose = _text(form, "purpose")
        check_purpose(purpose)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InvalidRequestError("the form needs a `file`", param="file")
        upload.file.seek(0, 2)
        if upload.file.tell() > limit:
            raise PayloadTooLargeError(f"the file is over {limit} bytes", param="file")
        upload.file.seek(0)
        record = await state.batch_files.create(
            caller.tenant,
            source=upload.file,
            filename=(upload.filename or "upload.jsonl")[:255],
            purpose=purpose,
            expires_after_s=_expires_after(form),
        )
    finally:
        await form.close()
    return record.to_openai()


@router.get("/files")
async def list_files(
    caller: CurrentTenant,
    state: State,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    after: str | None = None,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
) -> dict[str, Any]:
    records, more = await state.batch_files.list(
        caller.tenant, purpose=purpose, limit=limit, after=after, order=order
    )
    return _page([r.to_openai() for r in records], more)


@router.get("/files/{file_id}")
async def retrieve_file(file_id: str, caller: CurrentTenant, state: State) -> dict[str, Any]:
    return (await state.batch_files.get(caller.tenant, file_id)).to_openai()


@router.get("/files/{file_id}/content")
async def file_content(file_id: str, caller: CurrentTenant, state: State) -> StreamingResponse:
    await state.batch_files.get(caller.tenant, file_id)
    chunks = state.batch_files.blobs.chunks(file_id)
    return StreamingResponse(_iterate(chunks), media_type="application/octet-stream")


@router.delete("/files/{file_id}")
async def delete_file(file_id: str, caller: CurrentTenant, state: State) -> dict[str, Any]:
    await state.batch_files.delete(caller.tenant, file_id)
    return {"id": file_id, "object": "file", "deleted": True}


@router.post("/batches")
async def create_batch(body: CreateBatch, caller: CurrentTenant, state: State) -> dict[str, Any]:
    batch = await state.batches.create(
        caller.tenant,
        input_file_id=body.input_file_id,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        metadata=body.metadata,
        output_expires_after_s=body.output_expires_after and body.output_expires_after.seconds,
    )
    return batch.to_openai()


@router.get("/batches")
async def list_batches(
    caller: CurrentTenant,
    state: State,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict[str, Any]:
    batches, more = await state.batches.list(caller.tenant, after=after, limit=limit)
    return _page([b.to_openai() for b in batches], more)


@router.get("/batches/{batch_id}")
async def retrieve_batch(batch_id: str, caller: CurrentTenant, state: State) -> dict[str, Any]:
    return (await state.batches.get(BatchRef(caller.tenant, batch_id))).to_openai()


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, caller: CurrentTenant, state: State) -> dict[str, Any]:
    return (await state.batches.cancel(BatchRef(caller.tenant, batch_id))).to_openai()


def _page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


def _text(form: FormData, name: str) -> str:
    values = form.getlist(name)
    if len(values) != 1 or not isinstance(values[0], str) or not values[0].strip():
        raise InvalidRequestError(f"the form needs exactly one `{name}`", param=name)
    return values[0].strip()


def _expires_after(form: FormData) -> int | None:
    anchor = form.get("expires_after[anchor]")
    seconds = form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at" or not isinstance(seconds, str) or not seconds.isdigit():
        raise InvalidRequestError(
            "expires_after needs anchor 'created_at' and a number of seconds",
            param="expires_after",
        )
    value = int(seconds)
    if not MIN_EXPIRES_AFTER_S <= value <= MAX_EXPIRES_AFTER_S:
        raise InvalidRequestError(
            f"expires_after.seconds must be between {MIN_EXPIRES_AFTER_S} and "
            f"{MAX_EXPIRES_AFTER_S}",
            param="expires_after",
        )
    return value


async def _iterate(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """A blob's chunks, each read off the event loop."""
    iterator = iter(chunks)
    while (chunk := await asyncio.to_thread(next, iterator, b"")) != b"":
        yield chunk
