"""A tenant's adapters from the edge: upload (or, for admins, a server-side directory),
validate against the base model, store by content id, name; and delete, unloading the
adapter from every worker once no name points at it.

Validation reads and checks every tensor (numpy work), so it runs in a thread, off the event
loop. Adapter errors propagate as `adapters.AdapterError` and become 400/413 at the edge.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import tempfile
from pathlib import Path

import grpc
from fastapi import Request

from adapters import ArchiveLimits, load_adapter_dir
from gateway.adapter_catalog import Removal
from gateway.errors import GatewayError, InvalidRequestError
from gateway.state import GatewayState
from gateway.tenants import TenantAdapter
from gateway.uploads import receive_adapter_upload
from gateway.worker_client import load_adapter, unload_adapter

log = logging.getLogger(__name__)

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
# Per worker; a worker that does not answer in time drops the adapter by LRU anyway.
UNLOAD_TIMEOUT_S = 5.0
PRELOAD_TIMEOUT_S = 30.0


def check_adapter_name(name: str, *, served_model_name: str) -> str:
    if not ADAPTER_NAME.match(name):
        raise InvalidRequestError(
            "adapter name must be 1-128 characters of letters, digits and . _ : / -, "
            "starting with a letter or digit",
            param="name",
        )
    if name == served_model_name:
        raise InvalidRequestError(
            f"{name!r} is the base model's name; pick another adapter name", param="name"
        )
    return name


async def register_adapter_dir(
    *, state: GatewayState, tenant: str, name: str, path: Path
) -> TenantAdapter:
    """Validate the adapter directory at `path`, store it, and name it for `tenant`."""
    settings = state.settings
    check_adapter_name(name, served_model_name=settings.served_model_name)
    await state.catalog.check_name_free(tenant, name)
    adapter = await asyncio.to_thread(
        load_adapter_dir,
        path,
        base=state.base,
        max_lora_rank=settings.max_lora_rank,
        max_bytes=settings.max_adapter_bytes,
    )
    return await state.catalog.register(tenant, name, adapter)


async def upload_adapter(request: Request, *, state: GatewayState, tenant: str) -> TenantAdapter:
    """Receive a multipart upload into a private staging directory inside the store's volume,
    register it, and remove the staging directory whatever happened."""
    settings = state.settings
    staging = Path(tempfile.mkdtemp(prefix=".upload-", dir=state.adapter_store.root))
    try:
        upload = await receive_adapter_upload(
            request,
            staging=staging,
            max_upload_bytes=settings.max_upload_bytes,
            archive_limits=ArchiveLimits(
                max_members=settings.max_archive_members,
                max_member_bytes=settings.max_adapter_bytes,
                max_total_bytes=settings.max_adapter_bytes + (1 << 20),
            ),
        )
        record = await register_adapter_dir(
            state=state, tenant=tenant, name=upload.name, path=upload.adapter_dir
        )
    finally:
        await asyncio.to_thread(shutil.rmtree, staging, ignore_errors=True)
    state.spawn(preload(state=state, adapter_id=record.adapter_id))
    return record


async def preload(*, state: GatewayState, adapter_id: str) -> None:
    """Load a new adapter on the worker its first request will be routed to, while the
    upload's response travels back: the first request then finds it loaded. Best effort:
    a failure only means the first request loads it itself."""
    try:
        favourite = (await state.workers.candidates(adapter_id=adapter_id))[0]
        await load_adapter(
            state.channels,
            address=favourite.address,
            adapter_id=adapter_id,
            timeout_s=PRELOAD_TIMEOUT_S,
        )
    except (GatewayError, grpc.RpcError) as exc:
        log.info("preloading adapter %s skipped: %s", adapter_id, exc)


async def delete_adapter(*, state: GatewayState, tenant: str, name: str) -> Removal:
    """Forget the name at once (new requests get 404); unload from workers if it was the
    content's last name. Requests already running on a worker finish with their weights."""
    removal = await state.catalog.remove(tenant, name)
    if removal.last_reference:
        workers = await state.workers.workers()
        await asyncio.gather(
            *(
                unload_adapter(
                    state.channels,
                    address=w.address,
                    adapter_id=removal.record.adapter_id,
                    timeout_s=UNLOAD_TIMEOUT_S,
                )
                # Every live worker, not only those whose last heartbeat listed it: one
                # may have loaded it since.
                for w in workers
            )
        )
    return removal
