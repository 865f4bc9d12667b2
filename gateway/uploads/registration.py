"""A tenant's adapters from the edge: upload (or, for admins, a server-side directory),
validate against the base model, store by content id, name; and delete, unloading the
adapter from every worker once no name points at it.

Validation runs in a child process under CPU and memory limits (`gateway.uploads.validation`),
never on the event loop. A tenant has at most `max_concurrent_uploads` uploads in flight.
Adapter errors propagate as `adapters.AdapterError` and become 400/413 at the edge.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Collection
from pathlib import Path

import grpc
from fastapi import Request

from gateway.errors import GatewayError, InvalidRequestError
from gateway.fleet.bases import ServedBase
from gateway.state import GatewayState
from gateway.tenancy.tenants import TenantAdapter
from gateway.uploads.catalog import Registration, Removal
from gateway.uploads.staging import receive_adapter_upload
from gateway.worker_client import load_adapter, unload_adapter

log = logging.getLogger(__name__)

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
# Per worker; a worker that does not answer in time drops the adapter by LRU anyway.
UNLOAD_TIMEOUT_S = 5.0
PRELOAD_TIMEOUT_S = 30.0


def check_adapter_name(name: str, *, served_model_name: str | Collection[str]) -> str:
    """A well-formed name that is no served base's name."""
    bases = {served_model_name} if isinstance(served_model_name, str) else set(served_model_name)
    if not ADAPTER_NAME.match(name):
        raise InvalidRequestError(
            "adapter name must be 1-128 characters of letters, digits and . _ : / -, "
            "starting with a letter or digit",
            param="name",
        )
    if name in bases:
        raise InvalidRequestError(
            f"{name!r} is the base model's name; pick another adapter name", param="name"
        )
    return name


async def register_adapter_dir(
    *, state: GatewayState, tenant: str, name: str, path: Path
) -> TenantAdapter:
    """Validate the server-side adapter directory at `path`, store it, name it for `tenant`."""
    async with state.catalog.upload_slot(tenant), _staging(state) as staging:
        registration = await _register(
            state=state, tenant=tenant, name=name, source="dir", path=path, staging=staging
        )
    return registration.record


async def upload_adapter(request: Request, *, state: GatewayState, tenant: str) -> Registration:
    """Receive a multipart upload into a private staging directory inside the store's volume,
    validate and register it, and remove the staging directory whatever happened."""
    async with state.catalog.upload_slot(tenant), _staging(state) as staging:
        upload = await receive_adapter_upload(
            request, staging=staging, max_upload_bytes=state.settings.max_upload_bytes
        )
        registration = await _register(
            state=state,
            tenant=tenant,
            name=upload.name,
            source=upload.source,
            path=upload.path,
            staging=staging,
            replace=upload.replace,
            base=upload.base,
        )
    if registration.replaced is not None and registration.replaced.last_reference:
        await _unload_everywhere(state, registration.replaced.record.adapter_id)
    if registration.created or registration.replaced is not None:
        record = registration.record
        state.spawn(preload(state=state, adapter_id=record.adapter_id, base=record.base or None))
    return registration


async def _register(
    *,
    state: GatewayState,
    tenant: str,
    name: str,
    source,
    path: Path,
    staging: Path,
    replace: bool = False,
    base: str | None = None,
) -> Registration:
    served = await served_bases(state)
    check_adapter_name(name, served_model_name=served.keys())
    validated = await state.catalog.validator.validate(
        source=source,
        path=path,
        work_dir=staging,
        tenant=tenant,
        bases={n: b.spec for n, b in served.items()},
        default_base=state.bases.default.name,
        explicit_base=base,
    )
    return await state.catalog.register(tenant, name, validated, replace=replace)


async def served_bases(state: GatewayState) -> dict[str, ServedBase]:
    """The bases an upload may bind to: the default base and every live pool's."""
    served = {state.bases.default.name: state.bases.default}
    for name, pool in (await state.workers.pools()).items():
        with contextlib.suppress(GatewayError):  # one this gateway cannot read: not offered
            served[name] = await state.bases.served(pool)
    return served


@contextlib.asynccontextmanager
async def _staging(state: GatewayState) -> AsyncIterator[Path]:
    """A private directory in the store's volume (so blobs move into place by rename);
    removed afterwards, or by the store's sweep if the gateway dies first."""
    root = state.adapter_store.root
    staging = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix=".upload-", dir=root))
    try:
        yield staging
    finally:
        await asyncio.to_thread(shutil.rmtree, staging, ignore_errors=True)


async def preload(*, state: GatewayState, adapter_id: str, base: str | None = None) -> None:
    """Load a new adapter on the worker its first request will be routed to, while the
    upload's response travels back: the first request then finds it loaded. Best effort:
    a failure only means the first request loads it itself."""
    try:
        favourite = (await state.workers.candidates(adapter_id=adapter_id, base=base))[0]
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
        await _unload_everywhere(state, removal.record.adapter_id)
    return removal


async def _unload_everywhere(state: GatewayState, adapter_id: str) -> None:
    """Unload content no name points at any more (requests running on it finish first)."""
    workers = await state.workers.workers()
    await asyncio.gather(
        *(
            unload_adapter(
                state.channels, address=w.address, adapter_id=adapter_id, timeout_s=UNLOAD_TIMEOUT_S
            )
            # Every live worker, not only those whose last heartbeat listed it: one may have
            # loaded it since.
            for w in workers
        )
    )
