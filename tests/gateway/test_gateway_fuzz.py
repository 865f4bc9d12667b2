"""Fuzz the OpenAI endpoints with schemathesis, from the app's own OpenAPI schema, over real
HTTP against a running gateway (real Redis, a ScriptedWorker): whatever the body, the
answer is never a 5xx, and every error is in OpenAI's format."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway_support import (
    ADMIN_TOKEN,
    MODEL_NAME,
    gateway_settings,
    gateway_with_worker,
    make_model_dir,
)

pytestmark = pytest.mark.slow

# The schema comes from the app object itself (no server needed to read it).
SCHEMA = schemathesis.openapi.from_dict(
    create_app(GatewaySettings(admin_token=ADMIN_TOKEN, model=Path("unused"))).openapi()
).include(path_regex=r"^/v1/(completions|chat/completions|models|usage)$")


class GatewayThread:
    """`gateway_with_worker` running in its own thread and event loop, for sync tests."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.ready = threading.Event()
        self.stop: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.url = ""
        self.key = ""
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to the test through `start`
            self.error = exc
            self.ready.set()

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.stop = asyncio.Event()
        async with gateway_with_worker(self.settings) as live:
            self.url, self.key = live.gw.url, live.keys["acme"]
            self.ready.set()
            await self.stop.wait()

    def start(self) -> GatewayThread:
        self.thread.start()
        self.ready.wait(60)
        if self.error is not None:
            raise self.error
        return self

    def close(self) -> None:
        if self.loop is not None and self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


@pytest.fixture(scope="module")
def live(redis_url, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    prefix = f"sbtest:fuzz:{id(tmp)}:"
    running = GatewayThread(
        gateway_settings(
            redis_url=redis_url,
            prefix=prefix,
            model_dir=make_model_dir(tmp / "model"),
            store=tmp / "store",
            # A long run on a loaded machine: the worker registers once and must stay live.
            worker_heartbeat_ttl_s=3600,
        )
    ).start()
    yield running
    running.close()


@SCHEMA.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # the same examples every run: CI stays reproducible
)
def test_no_5xx_and_openai_shaped_errors(case, live):
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        # A model that exists, so the fuzzed fields reach tokenization, admission and a worker
        # (random names would all stop at the 404).
        case.body["model"] = MODEL_NAME
    response = case.call(
        base_url=live.url, headers={"Authorization": f"Bearer {live.key}"}, timeout=30
    )
    assert response.status_code < 500, (case.as_curl_command(), response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, response.text
        assert isinstance(error["message"], str) and error["message"]
