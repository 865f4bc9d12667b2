"""Each served base's tokenizer, chat template, config and limits, loaded when its pool first
appears, without a restart.

The gateway reads a base from a checkpoint directory, as it always has (`SWITCHBOARD_MODEL`
for the default base): a new base's directory is the one its workers published
(``WorkerInfo.model_path``), read only when it lies under one of the gateway's
`model_roots` (a Redis record never makes the gateway read an arbitrary path), and only its
tokenizer files and config.json, never the weights. Entries are cached by the base's content
id, so a base replaced under its name (new content, new id) gets its own entry; loading runs
on a thread, once per id however many requests wait for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters import BaseModelSpec
from gateway.errors import BaseUnavailableError
from gateway.fleet.pools import Pool
from gateway.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServedBase:
    """What requests for one base are resolved against."""

    name: str
    content_id: str  # "" for the default base until a worker reports its id
    tokenizer: ChatTokenizer
    spec: BaseModelSpec  # the shapes adapters are validated against
    config: dict[str, Any]
    max_model_len: int


def context_length(config: dict[str, Any], configured: int) -> int:
    """`configured` when set, else the checkpoint's max_position_embeddings."""
    if configured:
        return configured
    length = config.get("max_position_embeddings")
    if not isinstance(length, int) or length <= 0:
        raise ValueError(
            "config.json has no max_position_embeddings; set SWITCHBOARD_MAX_MODEL_LEN"
        )
    return length


def read_base(
    path: Path, *, name: str, content_id: str, max_model_len: int = 0, threads: int = 2
) -> ServedBase:
    """A checkpoint directory's tokenizer, template and config (blocking: call on a thread)."""
    config = json.loads((path / "config.json").read_text())
    return ServedBase(
        name=name,
        content_id=content_id,
        tokenizer=ChatTokenizer.from_dir(path, threads=threads),
        spec=BaseModelSpec.from_config_dict(config),
        config=config,
        max_model_len=context_length(config, max_model_len),
    )


class BaseCatalog:
    """The default base (read at start) and every other base read when first needed."""

    def __init__(
        self, default: ServedBase, *, roots: Sequence[Path], tokenizer_threads: int = 2
    ) -> None:
        self.default = default
        self.roots = tuple(Path(r).resolve() for r in roots)
        self.tokenizer_threads = tokenizer_threads
        self._by_id: dict[str, ServedBase] = {}
        self._loading: dict[str, asyncio.Future[ServedBase]] = {}
        # The last base served under each name: a request for a base whose pool is gone is
        # still parsed and checked against it (400s first), then routing's 503 names it.
        self._by_name: dict[str, ServedBase] = {default.name: default}

    @classmethod
    async def open(
        cls, model: Path, *, name: str, max_model_len: int, roots: Sequence[Path], threads: int
    ) -> BaseCatalog:
        default = await asyncio.to_thread(
            read_base, model, name=name, content_id="", max_model_len=max_model_len,
            threads=threads,
        )  # fmt: skip
        return cls(default, roots=roots, tokenizer_threads=threads)

    def cached(self, pool: Pool) -> ServedBase | None:
        """The pool's base if already read (no waiting)."""
        if pool.base == self.default.name:
            return self._default_as(pool)
        return self._by_id.get(pool.base_id)

    async def served(self, pool: Pool) -> ServedBase:
        """The pool's base, read once per content id on a thread; BaseUnavailableError when
        its directory is not one this gateway may read."""
        known = self.cached(pool)
        if known is not None:
            self._by_name[pool.base] = known
            return known
        loading = self._loading.get(pool.base_id)
        if loading is None:
            loading = asyncio.ensure_future(self._read(pool))
            self._loading[pool.base_id] = loading
            loading.add_done_callback(lambda _: self._loading.pop(pool.base_id, None))
        return await asyncio.shield(loading)

    async def _read(self, pool: Pool) -> ServedBase:
        path = self._readable(pool)
        try:
            base = await asyncio.to_thread(
                read_base, path, name=pool.base, content_id=pool.base_id,
                threads=self.tokenizer_threads,
            )  # fmt: skip
        except (OSError, ValueError, RuntimeError) as exc:
            log.warning("reading base %s from %s failed: %s", pool.base, path, exc)
            raise BaseUnavailableError(pool.base, "its tokenizer files cannot be read") from exc
        self._by_id[pool.base_id] = base
        self._by_name[pool.base] = base
        log.info("serving base %s (%s) from %s", pool.base, pool.base_id[:12], path)
        return base

    def last_served(self, name: str) -> ServedBase | None:
        """The base last served under ``name`` (the default base always), or None."""
        return self._by_name.get(name)

    def _readable(self, pool: Pool) -> Path:
        if not pool.model_path:
            raise BaseUnavailableError(pool.base, "its workers publish no checkpoint")
        path = Path(pool.model_path).resolve()
        if not any(path.is_relative_to(root) for root in self.roots):
            log.warning("base %s: %s is outside the gateway's model roots", pool.base, path)
            raise BaseUnavailableError(pool.base, "its checkpoint is not readable by the gateway")
        return path

    def _default_as(self, pool: Pool) -> ServedBase:
        if pool.base_id != self.default.content_id:  # the id its workers report, kept
            self.default = dataclasses.replace(self.default, content_id=pool.base_id)
        return self.default

    def close(self) -> None:
        for base in (self.default, *self._by_id.values()):
            base.tokenizer.close()
