"""An upload's whole validation in a child process under CPU-time and memory limits:
`python -m adapters.isolated` reads one job (JSON) on stdin and writes one answer on stdout.

Everything that touches the tenant's bytes runs here: archive extraction, config parsing,
safetensors reading, the finite-values check, and writing the canonical blob into the job's
work directory (so the gateway never holds the weights). The limits are set once the code is
imported and before the tenant's bytes are opened: RLIMIT_CPU (the kernel sends SIGXCPU,
then SIGKILL a second later), RLIMIT_AS (an allocation past it raises MemoryError, answered
as such) and RLIMIT_FSIZE.
A child that dies takes nothing with it; the gateway maps its end to a 4xx.

Job: {"source": "archive" | "dir", "path", "work_dir", "base": BaseModelSpec fields,
      "bases": {name: BaseModelSpec fields} (optional), "default_base", "explicit_base",
      "max_lora_rank", "max_bytes", "archive": ArchiveLimits fields,
      "cpu_s", "memory_bytes", "file_bytes"}
      The adapter is validated against the base it binds to (`adapters.base_binding`), or
      against "base" when the job names no "bases".
Answer: {"ok": {"adapter_id", "rank", "target_modules", "num_bytes", "blob", "base"}}
     or {"error": {"kind", "message", "field"}}, kind an `adapters.errors` class name,
        "memory" or "internal".
"""

from __future__ import annotations

import json
import resource
import sys
import traceback
from pathlib import Path
from typing import Any

from adapters.archive import ArchiveLimits, unpack_adapter_archive
from adapters.base_binding import choose_base, declared_base
from adapters.base_model import BaseModelSpec
from adapters.errors import AdapterError
from adapters.peft_format import load_adapter_dir
from adapters.store import write_staged

BLOB_DIR = "blob"
ADAPTER_DIR = "adapter"


def set_limits(*, cpu_s: int, memory_bytes: int, file_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Validate the job's adapter and write its canonical blob; the answer's `ok` part."""
    work = Path(job["work_dir"])
    source = Path(job["path"])
    if job["source"] == "archive":
        adapter_dir = work / ADAPTER_DIR
        adapter_dir.mkdir()
        unpack_adapter_archive(source, adapter_dir, limits=ArchiveLimits(**job["archive"]))
    else:
        adapter_dir = source
    bases = job.get("bases") or {job.get("default_base", ""): job["base"]}
    bound = choose_base(
        explicit=job.get("explicit_base"),
        declared=declared_base(adapter_dir) if job.get("bases") else None,
        served=bases.keys(),
        default=job.get("default_base", ""),
    )
    adapter = load_adapter_dir(
        adapter_dir,
        base=BaseModelSpec(**bases[bound]),
        max_lora_rank=job["max_lora_rank"],
        max_bytes=job["max_bytes"],
    )
    blob = work / BLOB_DIR
    blob.mkdir()
    write_staged(adapter, blob)
    return {
        "adapter_id": adapter.id,
        "rank": adapter.max_rank,
        "target_modules": sorted(adapter.target_modules),
        "num_bytes": adapter.num_bytes,
        "blob": str(blob),
        "base": bound,
    }


def main() -> int:
    job = json.loads(sys.stdin.buffer.read())  # from the gateway, not the tenant
    set_limits(cpu_s=job["cpu_s"], memory_bytes=job["memory_bytes"], file_bytes=job["file_bytes"])
    try:
        answer: dict[str, Any] = {"ok": run(job)}
    except AdapterError as exc:
        answer = {"error": {"kind": type(exc).__name__, "message": str(exc), "field": exc.field}}
    except MemoryError:
        answer = {"error": {"kind": "memory", "message": "", "field": None}}
    except Exception as exc:  # a bug, or a library failing on hostile bytes: say so, in full
        traceback.print_exc()
        answer = {"error": {"kind": "internal", "message": repr(exc)[:500], "field": None}}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
