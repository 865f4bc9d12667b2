"""What the gateway holds while it runs: built by the app's lifespan, closed with it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from adapters import BaseModelSpec
from adapters.stores import AdapterStore
from gateway.batch.batches import BatchService
from gateway.batch.files import FileService
from gateway.fair_queue import FairQueue
from gateway.fleet.bases import BaseCatalog
from gateway.routing import WorkerDirectory
from gateway.settings import GatewaySettings
from gateway.structured.grammar_checker import GrammarChecker
from gateway.tenancy.quotas import QuotaService
from gateway.tenancy.tenants import TenantStore
from gateway.tenancy.weights import TenantWeights
from gateway.tokenizer import ChatTokenizer
from gateway.uploads.catalog import AdapterCatalog
from gateway.worker_client import WorkerChannels


@dataclass
class GatewayState:
    settings: GatewaySettings
    redis: aioredis.Redis
    tenants: TenantStore
    bases: BaseCatalog  # every served base's tokenizer, template, config and limits
    adapter_store: AdapterStore  # the backend the settings chose (`adapters.stores.open_store`)
    catalog: AdapterCatalog
    quotas: QuotaService
    workers: WorkerDirectory
    channels: WorkerChannels
    weights: TenantWeights
    fair_queue: FairQueue
    grammars: GrammarChecker
    batch_files: FileService
    batches: BatchService
    # Fire-and-forget work (adapter preloads), held so it is not garbage-collected mid-way
    # and cancelled at shutdown.
    background: set[asyncio.Task] = field(default_factory=set)

    @property
    def tokenizer(self) -> ChatTokenizer:
        """The default base's tokenizer."""
        return self.bases.default.tokenizer

    @property
    def base(self) -> BaseModelSpec:
        """The default base's shapes."""
        return self.bases.default.spec

    @property
    def max_model_len(self) -> int:
        """The default base's context."""
        return self.bases.default.max_model_len

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def close(self) -> None:
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        await self.channels.close()
        await self.grammars.close()
        await self.quotas.close()
        await self.redis.aclose()
        self.bases.close()
