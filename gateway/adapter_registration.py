"""Registering a tenant's PEFT adapter: validate it against the base model, store it by
content id, and record the tenant's name for it in Redis.

Validation reads and checks every tensor (numpy work), so it runs in a thread, off the event
loop. Adapter errors propagate as `adapters.AdapterError` and become 400/413 at the edge.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

from adapters import BaseModelSpec, FilesystemAdapterStore, load_adapter_dir
from gateway.errors import InvalidRequestError
from gateway.tenants import TenantAdapter, TenantStore

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


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


def _validate_and_store(
    path: Path,
    *,
    base: BaseModelSpec,
    store: FilesystemAdapterStore,
    max_lora_rank: int,
    max_bytes: int,
) -> tuple[str, Path]:
    adapter = load_adapter_dir(path, base=base, max_lora_rank=max_lora_rank, max_bytes=max_bytes)
    adapter_id = store.put(adapter)
    return adapter_id, store.get(adapter_id)


async def register_adapter(
    *,
    tenants: TenantStore,
    tenant: str,
    name: str,
    path: str,
    base: BaseModelSpec,
    store: FilesystemAdapterStore,
    served_model_name: str,
    max_lora_rank: int,
    max_bytes: int,
) -> TenantAdapter:
    """Validate the adapter directory at `path`, store it, and name it for `tenant`."""
    await tenants.require_tenant(tenant)
    check_adapter_name(name, served_model_name=served_model_name)
    adapter_id, stored = await asyncio.to_thread(
        _validate_and_store,
        Path(path),
        base=base,
        store=store,
        max_lora_rank=max_lora_rank,
        max_bytes=max_bytes,
    )
    record = TenantAdapter(
        name=name, adapter_id=adapter_id, path=str(stored), created_at=int(time.time())
    )
    await tenants.add_adapter(tenant, record)
    return record
