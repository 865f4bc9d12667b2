"""Receive a tenant's adapter upload (multipart/form-data) into a staging directory.

Two shapes are accepted, both with a `name` field (and optionally `replace`, and `base_model`,
the served base the adapter binds to, which wins over its config's `base_model_name_or_path`):
- `file`: one `.tar.gz` / `.tgz` / `.tar` / `.zip` archive of a PEFT adapter directory;
- `adapter_config` + `adapter_model`: the two files themselves.

The body is bounded while it streams (a declared Content-Length over the limit is refused
before anything is read; a chunked body is cut off at the limit). Starlette's multipart
parser spools file parts to temporary files past 1 MiB, so an upload is never held in
memory; we then copy the parts into the staging directory under fixed names (never the
client's file names). Archives are unpacked by the validation child
(`gateway.uploads.validation`), never in the gateway.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

from fastapi import Request
from starlette.datastructures import FormData, UploadFile
from starlette.types import Message

from adapters.peft_config import CONFIG_FILE
from adapters.peft_names import WEIGHTS_FILE
from gateway.errors import InvalidRequestError, PayloadTooLargeError

ARCHIVE_FIELD = "file"
FILE_FIELDS = {"adapter_config": CONFIG_FILE, "adapter_model": WEIGHTS_FILE}
TEXT_FIELDS = frozenset({"name", "replace", "base_model"})
MAX_TEXT_FIELD_BYTES = 4096
MAX_PARTS = 8


@dataclass(frozen=True, slots=True)
class ReceivedUpload:
    name: str
    source: Literal["archive", "dir"]
    path: Path  # the archive, or a directory with the adapter's two files
    replace: bool = False  # new content may replace what the name holds (a new version)
    base: str | None = None  # the `base_model` field: the served base it binds to


async def receive_adapter_upload(
    request: Request, *, staging: Path, max_upload_bytes: int
) -> ReceivedUpload:
    """Parse the multipart body into `staging` (an empty directory the caller removes)."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidRequestError(
            "upload the adapter as multipart/form-data with a `name` field and either a "
            "`file` archive or `adapter_config` and `adapter_model` files",
            param="content-type",
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_upload_bytes:
        raise _too_large(max_upload_bytes)
    # A little room over the expected counts, so that a stray field is named in the error.
    form = await bounded(request, max_upload_bytes).form(
        max_files=MAX_PARTS, max_fields=MAX_PARTS, max_part_size=MAX_TEXT_FIELD_BYTES
    )
    try:
        name = _text_field(form, "name")
        replace = _flag_field(form, "replace")
        base = _optional_text_field(form, "base_model")
        files = _file_fields(form)
        # Copying up to the size limit is disk work: off the event loop.
        source, path = await asyncio.to_thread(_materialize, files, staging)
        return ReceivedUpload(name=name, source=source, path=path, replace=replace, base=base)
    finally:
        await form.close()


def _materialize(
    files: dict[str, UploadFile], staging: Path
) -> tuple[Literal["archive", "dir"], Path]:
    """`staging/upload.archive`, or the adapter's two files in `staging/files`."""
    if ARCHIVE_FIELD in files:
        archive = staging / "upload.archive"
        _save(files[ARCHIVE_FIELD], archive)
        return "archive", archive
    adapter_dir = staging / "files"
    adapter_dir.mkdir()
    for field, filename in FILE_FIELDS.items():
        _save(files[field], adapter_dir / filename)
    return "dir", adapter_dir


def bounded(request: Request, limit: int) -> Request:
    """The same request, whose body stream fails once more than `limit` bytes arrived."""
    received = 0

    async def receive() -> Message:
        nonlocal received
        message = await request.receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise _too_large(limit)
        return message

    return Request(request.scope, receive)


def _text_field(form: FormData, field: str) -> str:
    values = form.getlist(field)
    if len(values) != 1 or not isinstance(values[0], str) or not values[0].strip():
        raise InvalidRequestError(f"the form needs exactly one non-empty `{field}`", param=field)
    return values[0].strip()


def _optional_text_field(form: FormData, field: str) -> str | None:
    """An optional text field of at most 256 printable characters (absent: None)."""
    values = form.getlist(field)
    if not values:
        return None
    if len(values) != 1 or not isinstance(values[0], str):
        raise InvalidRequestError(f"the form takes at most one `{field}`", param=field)
    value = values[0].strip()
    if not value or len(value) > 256 or not value.isprintable():
        raise InvalidRequestError(f"`{field}` must be 1-256 printable characters", param=field)
    return value


def _flag_field(form: FormData, field: str) -> bool:
    """An optional `true` / `false` field (absent: false)."""
    values = form.getlist(field)
    if not values:
        return False
    if len(values) != 1 or not isinstance(values[0], str):
        raise InvalidRequestError(f"the form takes at most one `{field}`", param=field)
    value = values[0].strip().lower()
    if value not in ("true", "false"):
        raise InvalidRequestError(
            f"`{field}` must be true or false, got {value[:20]!r}", param=field
        )
    return value == "true"


def _file_fields(form: FormData) -> dict[str, UploadFile]:
    files: dict[str, UploadFile] = {}
    for field, value in form.multi_items():
        if field in TEXT_FIELDS:
            continue
        if field != ARCHIVE_FIELD and field not in FILE_FIELDS:
            raise InvalidRequestError(f"unexpected form field `{field}`", param=field)
        if not isinstance(value, UploadFile):
            raise InvalidRequestError(f"`{field}` must be a file", param=field)
        if field in files:
            raise InvalidRequestError(f"`{field}` was sent twice", param=field)
        files[field] = value
    if set(files) == {ARCHIVE_FIELD} or set(files) == set(FILE_FIELDS):
        return files
    raise InvalidRequestError(
        "send either one `file` archive or both `adapter_config` and `adapter_model`",
        param=ARCHIVE_FIELD,
    )


def _save(upload: UploadFile, path: Path) -> None:
    source: BinaryIO = upload.file
    source.seek(0)
    with path.open("xb") as out:
        shutil.copyfileobj(source, out, length=1 << 20)


def _too_large(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"the upload is over {limit} bytes", param="file")
