"""The demo key `switchboard up` prints, kept between starts so that it is reused.

Redis holds only a key's hash; the key itself lives here, in a file readable by its owner
alone, named by a digest of the Redis address, key prefix and tenant it belongs to.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TypedDict

from runtime.home import switchboard_home


class KeptKey(TypedDict):
    key_id: str
    key: str


def up_key_path(home: Path | None, scope: str) -> Path:
    """The file for one Redis, prefix and tenant (`scope`), under `$SWITCHBOARD_HOME/up-keys`."""
    digest = hashlib.sha256(scope.encode()).hexdigest()[:24]
    return (home or switchboard_home()) / "up-keys" / f"{digest}.json"


def read_kept_key(path: Path) -> KeptKey | None:
    """The kept key, or None when there is none or the file is not one of ours."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    key_id, key = record.get("key_id"), record.get("key")
    if not (isinstance(key_id, str) and isinstance(key, str)):
        return None
    return KeptKey(key_id=key_id, key=key)


def keep_key(path: Path, *, key_id: str, key: str) -> None:
    """Write the key with mode 0600 from the start (never readable by others, even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    temporary = path.with_suffix(".tmp")
    temporary.unlink(missing_ok=True)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump({"key_id": key_id, "key": key}, handle)
    temporary.replace(path)
