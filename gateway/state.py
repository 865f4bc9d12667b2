"""What the gateway holds while it runs: built by the app's lifespan, closed with it."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from adapters import BaseModelSpec, FilesystemAdapterStore
from gateway.adapter_catalog import AdapterCatalog
from gateway.quotas import QuotaService
from gateway.routing import WorkerDirectory
from gateway.settings import GatewaySettings
from gateway.tenants import TenantStore
from gateway.tokenizer import ChatTokenizer
from gateway.worker_client import WorkerChannels


@dataclass
class GatewayState:
    settings: GatewaySettings
    redis: aioredis.Redis
    tenants: TenantStore
    tokenizer: ChatTokenizer
    base: BaseModelSpec
    max_model_len: int
    adapter_store: FilesystemAdapterStore
    catalog: AdapterCatalog
    quotas: QuotaService
    workers: WorkerDirectory
    channels: WorkerChannels

    async def close(self) -> None:
        await self.channels.close()
        await self.redis.aclose()
