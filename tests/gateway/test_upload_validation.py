"""gateway.uploads.validation: the child's limits and how its end is answered, without an app.

(The refusals of hostile files through the whole gateway are in test_upload_races.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from adapters import ArchiveLimits, InvalidAdapterError
from gateway.uploads.validation import UploadValidationLimitError, UploadValidator, ValidationLimits
from gateway_support import TINY_CONFIG, write_adapter


def validator(**limits) -> UploadValidator:
    from adapters import BaseModelSpec

    values = {"cpu_s": 1, "memory_bytes": 1 << 30, "wall_s": 2.0, "concurrency": 2, **limits}
    return UploadValidator(
        base=BaseModelSpec.from_config_dict(TINY_CONFIG),
        max_lora_rank=8,
        max_bytes=1 << 20,
        archive_limits=ArchiveLimits(max_members=8),
        limits=ValidationLimits(**values),
    )


async def test_a_valid_directory_comes_back_as_a_staged_blob(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    done = await validator().validate(
        source="dir", path=write_adapter(tmp_path / "a"), work_dir=work
    )
    assert len(done.adapter_id) == 64 and done.rank == 4 and done.num_bytes == 7168
    assert done.target_modules == ["q_proj", "v_proj"]
    assert sorted(p.name for p in done.blob.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]


async def test_the_childs_adapter_errors_keep_their_type(tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "a")
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": -1}')
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(InvalidAdapterError, match="r must be a positive integer") as caught:
        await validator().validate(source="dir", path=adapter, work_dir=work)
    assert caught.value.field == "r"


async def test_a_child_past_its_time_is_killed_and_answered_422(tmp_path: Path) -> None:
    """A child that never finishes (here: blocked opening a FIFO nobody writes) is killed at
    the wall-time limit; the caller gets a 422, in time."""
    fifo = tmp_path / "upload.archive"
    os.mkfifo(fifo)
    work = tmp_path / "work"
    work.mkdir()
    started = time.monotonic()
    with pytest.raises(UploadValidationLimitError, match="past its limit") as caught:
        await validator(wall_s=1.0).validate(source="archive", path=fifo, work_dir=work)
    assert caught.value.status == 422
    # Killed at wall_s, counted from the child's start (spawning it can take seconds on a
    # loaded machine): never before it, and nowhere near "never" (the FIFO blocks forever).
    assert 1.0 <= time.monotonic() - started < 30


def test_a_child_that_ends_before_reading_its_job_is_a_422_not_a_crash(
    tmp_path: Path, monkeypatch
) -> None:
    """A child gone before the gateway's loop got round to writing its job (here: spawning
    returns 50 ms late, as on a busy loop): the write fails (EPIPE, which uvloop, the
    gateway's loop, raises as RuntimeError), and the caller still gets a refusal with the
    child's last words logged, never the write's error."""
    import asyncio

    import uvloop

    from gateway.child_processes import Child
    from gateway.uploads import validation as upload_validation

    spawn = Child.start

    async def spawn_then_stall(*args, **kwargs):
        child = await spawn(*args, **kwargs)
        await asyncio.sleep(0.05)
        return child

    monkeypatch.setattr(upload_validation, "CHILD", ["true"])
    monkeypatch.setattr(upload_validation.Child, "start", spawn_then_stall)
    checker = validator()
    checker.job["padding"] = "x" * (4 << 20)  # past any pipe buffer
    work = tmp_path / "work"
    work.mkdir()
    job = checker.validate(source="dir", path=write_adapter(tmp_path / "a"), work_dir=work)
    with pytest.raises(UploadValidationLimitError, match="ended abnormally") as caught:
        uvloop.run(job)
    assert caught.value.status == 422
