"""Validate an upload in a fresh child process (`adapters.isolated`) with CPU-time and
memory limits, so no upload can stall the event loop or exhaust the gateway's memory.

A fresh `python -m adapters.isolated` per upload, rather than a process pool: each child
starts with its own limits and a clean address space, and one killed by a limit takes no
other upload's work with it (a pool's broken worker fails every task in flight). Its start
(Python, numpy and adapters imported) is small next to receiving an upload
(docs/performance.md). At most `limits.concurrency` run at once, shared fairly by tenants
(`gateway.fair_slots`): one tenant's validation at a time (a tenant's uploads in flight are
bounded by its own quota, `max_concurrent_uploads`), a freed slot to the waiting tenant that
has held them least, so one tenant's slow uploads never hold every slot.

A child's end becomes an error in OpenAI's format: its own refusals keep their adapter
error (400/413), memory past its limit is 413, CPU time or wall time past its limit 422.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from adapters import ArchiveLimits, BaseModelSpec, errors
from gateway.child_processes import Child
from gateway.errors import GatewayError, PayloadTooLargeError
from gateway.fair_slots import FairSlots

log = logging.getLogger(__name__)

CHILD = [sys.executable, "-m", "adapters.isolated"]
# One thread each for numpy's BLAS and malloc: a child's address space is its limit, and
# per-thread arenas and buffers would spend it on nothing.
CHILD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1"}
# What the child keeps of the gateway's environment: nothing secret (the admin token, Redis
# credentials) reaches the process that parses a tenant's bytes.
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")
ADAPTER_ERRORS = {
    cls.__name__: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.AdapterError)
}


class UploadValidationLimitError(GatewayError):
    """Validating the upload ran past its CPU or wall-time limit (a hostile or broken file)."""

    status = 422
    type = "invalid_request_error"
    code = "upload_validation_limit"


# A tenant's validations waiting at most (its uploads in flight are bounded by its quota first).
QUEUE_PER_TENANT = 16


@dataclass(frozen=True, slots=True)
class ValidatedUpload:
    """What the child found; `blob` is the canonical directory it wrote, ready to adopt."""

    adapter_id: str
    rank: int
    target_modules: list[str]
    num_bytes: int
    blob: Path
    base: str = ""  # the served base it was validated against and is bound to


@dataclass(frozen=True, slots=True)
class ValidationLimits:
    cpu_s: int
    memory_bytes: int
    wall_s: float
    concurrency: int


class UploadValidator:
    """Runs validation children for one gateway, at most `limits.concurrency` at a time."""

    def __init__(
        self,
        *,
        base: BaseModelSpec,
        max_lora_rank: int,
        max_bytes: int,
        archive_limits: ArchiveLimits,
        limits: ValidationLimits,
    ) -> None:
        self.job = {
            "base": dataclasses.asdict(base),
            "max_lora_rank": max_lora_rank,
            "max_bytes": max_bytes,
            "archive": dataclasses.asdict(archive_limits),
            "cpu_s": limits.cpu_s,
            "memory_bytes": limits.memory_bytes,
            # The largest file a child writes: the canonical weights (float32 <= max_bytes)
            # or an unpacked member, plus headers.
            "file_bytes": max(max_bytes, archive_limits.max_member_bytes) + (2 << 20),
        }
        self.limits = limits
        self._slots = FairSlots(
            slots=limits.concurrency,
            per_tenant=max(1, limits.concurrency // 2),
            queue_limit=QUEUE_PER_TENANT,
            name="upload validation",
        )

    async def validate(
        self,
        *,
        source: Literal["archive", "dir"],
        path: Path,
        work_dir: Path,
        tenant: str = "",
        bases: Mapping[str, BaseModelSpec] | None = None,
        default_base: str = "",
        explicit_base: str | None = None,
    ) -> ValidatedUpload:
        """Validate the archive or directory at `path` (in ``tenant``'s turn) against the
        served base it binds to (``bases`` by name; None: the validator's own base); the
        child writes into `work_dir`."""
        job = {**self.job, "source": source, "path": str(path), "work_dir": str(work_dir)}
        if bases is not None:
            job["bases"] = {name: dataclasses.asdict(spec) for name, spec in bases.items()}
        job["default_base"] = default_base
        job["explicit_base"] = explicit_base
        async with self._slots.hold(tenant):
            returncode, out, err = await self._run(json.dumps(job).encode())
        answer = _answer(out)
        if answer is None:
            raise self._died(returncode, err)
        if "ok" in answer:
            ok = answer["ok"]
            return ValidatedUpload(
                adapter_id=ok["adapter_id"],
                rank=ok["rank"],
                target_modules=ok["target_modules"],
                num_bytes=ok["num_bytes"],
                blob=Path(ok["blob"]),
                base=ok.get("base", ""),
            )
        raise self._refusal(answer["error"], err)

    async def _run(self, job: bytes) -> tuple[int, bytes, bytes]:
        env = {**{k: os.environ[k] for k in INHERITED_ENV if k in os.environ}, **CHILD_ENV}
        child = await Child.start(CHILD, env=env, stderr=True)
        try:
            out, err = await asyncio.wait_for(child.communicate(job), self.limits.wall_s)
        except TimeoutError:
            await child.kill()
            return -signal.SIGALRM, b"", b"wall-time limit"
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            # The child ended before it read its job (uvloop reports the closed pipe as a
            # RuntimeError): what it said on the way out is all there is to report.
            err = await child.stderr.read() if child.stderr else b""
            await child.kill()
            assert child.returncode is not None
            return child.returncode, b"", err
        except BaseException:  # cancelled (client gone, shutdown): never leave it running
            await child.kill()
            raise
        assert child.returncode is not None
        return child.returncode, out, err

    def _died(self, returncode: int, err: bytes) -> GatewayError:
        if returncode in (-signal.SIGXCPU, -signal.SIGKILL, -signal.SIGALRM):
            return UploadValidationLimitError(
                f"validating the upload ran past its limit of {self.limits.cpu_s} s of CPU "
                "time; the file is malformed or too costly to check",
                param="file",
            )
        log.warning("upload validation child ended with %s: %s", returncode, err[-2000:])
        return UploadValidationLimitError(
            "validating the upload failed (the validation process ended abnormally)",
            param="file",
        )

    def _refusal(self, error: dict, err: bytes) -> Exception:
        kind = error["kind"]
        if kind in ADAPTER_ERRORS:
            return ADAPTER_ERRORS[kind](error["message"], field=error["field"])
        if kind == "memory":
            return PayloadTooLargeError(
                f"validating the upload needed more than {self.limits.memory_bytes} bytes "
                "of memory",
                param="file",
            )
        log.warning("upload validation failed inside the child: %s\n%s", error, err[-4000:])
        return UploadValidationLimitError(
            "the upload could not be validated (a file in it is malformed)", param="file"
        )


def _answer(out: bytes) -> dict | None:
    """The child's one-line answer, or None if it printed none (it was killed)."""
    lines = out.strip().splitlines()
    if not lines:
        return None
    try:
        answer = json.loads(lines[-1])
    except ValueError:
        return None
    return answer if isinstance(answer, dict) and ("ok" in answer or "error" in answer) else None
