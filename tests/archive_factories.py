"""Archives for upload tests, benign and hostile, built with the standard library.

Every builder returns the archive's bytes. `Member` describes one entry: a regular file by
default, or a symlink / hard link / device / fifo / directory by `kind`.
"""

from __future__ import annotations

import io
import pickle
import stat
import struct
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Member:
    name: str
    data: bytes = b""
    kind: str = "file"  # file | dir | symlink | hardlink | chardev | fifo
    target: str = ""  # for links


def adapter_members(adapter_dir: Path, *, folder: str = "") -> list[Member]:
    """The two files of a saved adapter, optionally inside `folder/`."""
    prefix = f"{folder}/" if folder else ""
    return [
        Member(prefix + name, (adapter_dir / name).read_bytes())
        for name in ("adapter_config.json", "adapter_model.safetensors")
    ]


_TAR_TYPES = {
    "file": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "chardev": tarfile.CHRTYPE,
    "fifo": tarfile.FIFOTYPE,
}


def tar_bytes(members: list[Member], *, gzipped: bool = True) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if gzipped else "w") as tar:
        for m in members:
            info = tarfile.TarInfo(m.name)
            info.type = _TAR_TYPES[m.kind]
            info.linkname = m.target
            info.size = len(m.data) if m.kind == "file" else 0
            info.mode = 0o755 if m.kind == "dir" else 0o644
            tar.addfile(info, io.BytesIO(m.data) if m.kind == "file" else None)
    return buffer.getvalue()


def zip_bytes(members: list[Member]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for m in members:
            info = zipfile.ZipInfo(m.name)
            info.compress_type = zipfile.ZIP_DEFLATED
            if m.kind == "symlink":
                info.external_attr = (stat.S_IFLNK | 0o777) << 16
                zf.writestr(info, m.target)
            elif m.kind == "chardev":
                info.external_attr = (stat.S_IFCHR | 0o644) << 16
                zf.writestr(info, b"")
            else:
                info.external_attr = (stat.S_IFREG | 0o644) << 16
                zf.writestr(info, m.data)
    return buffer.getvalue()


def zeros_member(name: str, size: int) -> Member:
    """A member of `size` zero bytes: compresses ~1000:1, the classic bomb."""
    return Member(name, bytes(size))


class PicklePayload:
    """Unpickling this creates `marker`: proof, if the file exists, that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def pickle_bytes(marker: Path) -> bytes:
    return pickle.dumps(PicklePayload(marker))


def zip64_declaring(data: bytes, *, entries: int, directory_bytes: int | None = None) -> bytes:
    """`data` (a zip) whose end records claim `entries` members (and a directory of
    `directory_bytes`): a zip64 end record and locator before the classic end record, which
    points at them with 0xFFFF, as writers do past 65,535 entries. Nothing else changes."""
    end = data.rfind(b"PK\x05\x06")
    head, classic = data[:end], bytearray(data[end:])
    cd_size = int.from_bytes(classic[12:16], "little")
    cd_offset = int.from_bytes(classic[16:20], "little")
    record = (
        b"PK\x06\x06"
        + struct.pack("<QHHII", 44, 45, 45, 0, 0)
        + struct.pack("<QQQQ", entries, entries, directory_bytes or cd_size, cd_offset)
    )
    locator = b"PK\x06\x07" + struct.pack("<IQI", 0, len(head), 1)
    classic[8:12] = b"\xff\xff\xff\xff"  # entries on this disk / in total: see zip64
    return head + record + locator + bytes(classic)


def with_declared_size(data: bytes, member: str, size: int) -> bytes:
    """`data` (a zip) whose central directory declares `size` uncompressed bytes for `member`
    (its data unchanged): a header that lies, or a bomb announced honestly."""
    out = bytearray(data)
    at = out.find(b"PK\x01\x02")
    while at >= 0:
        name_len = int.from_bytes(out[at + 28 : at + 30], "little")
        if out[at + 46 : at + 46 + name_len].decode() == member:
            out[at + 24 : at + 28] = size.to_bytes(4, "little")
            return bytes(out)
        at = out.find(b"PK\x01\x02", at + 4)
    raise KeyError(member)
