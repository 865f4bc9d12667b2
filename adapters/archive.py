"""Unpack an uploaded adapter archive (`.tar.gz`, `.tgz`, `.tar`, `.zip`) without trusting it.

Safety comes from the shape of the code more than from checks: member names are never used
as paths. Each member is matched by its base name against the two files an adapter has,
and only those are written, under fixed names, into a directory the caller created. The
checks then refuse what a hostile archive tries, with an error naming the member:
absolute paths and `..` (traversal), links and device files, pickled weights, too many
members, and more bytes than the limits once decompressed. Sizes are counted on the bytes
actually produced, never taken from headers, so archive bombs stop at the limit.

Tar archives are read as a stream (`r|`) through a byte-counting reader, so even a bomb
hidden in a pax header stops at the limit. Zip keeps its directory at the end: its entry
count and size are read from the end record before `zipfile` reads the directory and builds
an object per entry. A member we would write is refused on its declared size before a byte
of it is decompressed (declared sizes can lie, so the copy counts again).
"""

from __future__ import annotations

import gzip
import io
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from adapters.errors import AdapterTooLargeError, InvalidAdapterError, UnsafeArchiveError
from adapters.peft_config import CONFIG_FILE
from adapters.peft_format import PICKLE_SUFFIXES
from adapters.peft_names import WEIGHTS_FILE

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
CHUNK = 1 << 20
# Tar headers and padding: up to three 512-byte blocks per member beyond its data.
TAR_OVERHEAD_PER_MEMBER = 1536
ZIP_END_RECORD = b"PK\x05\x06"
ZIP64_LOCATOR = b"PK\x06\x07"
# A directory entry is 46 bytes plus its name, extra field and comment: 32 members of real
# adapters take a few KiB.
MAX_ZIP_DIRECTORY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class ArchiveLimits:
    """Bounds on what an archive may expand to (the upload itself is bounded before)."""

    max_members: int = 32
    max_member_bytes: int = 256 << 20
    max_total_bytes: int = 256 << 20


def unpack_adapter_archive(archive: Path, dest: Path, *, limits: ArchiveLimits) -> None:
    """Write the adapter's `adapter_config.json` and `adapter_model.safetensors` from
    `archive` into the existing empty directory `dest`; raise an AdapterError otherwise."""
    with archive.open("rb") as f:
        head = f.read(512)
    if head.startswith(b"\x1f\x8b"):
        _unpack_tar(archive, dest, limits=limits, gzipped=True)
    elif head.startswith((b"PK\x03\x04", ZIP_END_RECORD)):
        _unpack_zip(archive, dest, limits=limits)
    elif len(head) == 512 and head[257:262] == b"ustar":
        _unpack_tar(archive, dest, limits=limits, gzipped=False)
    else:
        raise InvalidAdapterError("the upload is not a .tar.gz, .tar or .zip archive", field="file")
    for name in ADAPTER_FILES:
        if not (dest / name).is_file():
            raise InvalidAdapterError(f"the archive has no {name}", field=name)


class _Placement:
    """Decides, member by member, which of the adapter's files a member is, if any."""

    def __init__(self, dest: Path, limits: ArchiveLimits) -> None:
        self.dest = dest
        self.limits = limits
        self.members = 0
        self.written = 0
        self.declared = 0
        self.folder: tuple[str, ...] | None = None  # where the adapter's files sit

    def count(self, name: str) -> PurePosixPath:
        self.members += 1
        if self.members > self.limits.max_members:
            raise AdapterTooLargeError(
                f"the archive has more than {self.limits.max_members} members", field="file"
            )
        return _checked_path(name)

    def target(self, path: PurePosixPath) -> Path | None:
        """The output file for an adapter file at `path`; None for members we skip."""
        if path.name.lower().endswith(PICKLE_SUFFIXES):
            raise UnsafeArchiveError(
                f"{path}: pickled files are refused (loading them can run arbitrary code); "
                f"save the adapter with safe_serialization=True ({WEIGHTS_FILE})",
                field=str(path),
            )
        if path.name not in ADAPTER_FILES or len(path.parts) > 2:
            return None
        folder = path.parts[:-1]
        if self.folder is not None and folder != self.folder:
            raise InvalidAdapterError(
                f"{path}: the adapter's files must sit in one folder of the archive",
                field=str(path),
            )
        self.folder = folder
        out = self.dest / path.name
        if out.exists():
            raise InvalidAdapterError(f"{path}: the archive holds it twice", field=str(path))
        return out

    def check_declared(self, size: int, *, member: str) -> None:
        """Refuse a member on the size its header declares, before decompressing it."""
        if size > self.limits.max_member_bytes:
            raise AdapterTooLargeError(
                f"{member}: declares {size} bytes uncompressed, over "
                f"{self.limits.max_member_bytes}",
                field=member,
            )
        self.declared += size
        if self.declared > self.limits.max_total_bytes:
            raise AdapterTooLargeError(
                f"the archive's members declare over {self.limits.max_total_bytes} bytes",
                field="file",
            )

    def copy(self, source: BinaryIO, out: Path, *, member: str) -> None:
        """Copy at most the limits' bytes of `source` to `out` (a new file)."""
        size = 0
        with out.open("xb") as f:
            while chunk := source.read(CHUNK):
                size += len(chunk)
                self.written += len(chunk)
                if size > self.limits.max_member_bytes:
                    raise AdapterTooLargeError(
                        f"{member}: over {self.limits.max_member_bytes} bytes uncompressed",
                        field=member,
                    )
                if self.written > self.limits.max_total_bytes:
                    raise AdapterTooLargeError(
                        f"the archive expands past {self.limits.max_total_bytes} bytes",
                        field="file",
                    )
                f.write(chunk)


def _checked_path(name: str) -> PurePosixPath:
    """A member name as a relative path; traversal and absolute names are refused."""
    if not name or "\x00" in name:
        raise UnsafeArchiveError("an archive member has an empty or NUL-containing name")
    if "\\" in name:
        raise UnsafeArchiveError(f"{name!r}: backslashes in member names are refused", field=name)
    path = PurePosixPath(name)
    if path.is_absolute() or (path.parts and path.parts[0].endswith(":")):
        raise UnsafeArchiveError(f"{name!r}: absolute member paths are refused", field=name)
    if ".." in path.parts:
        raise UnsafeArchiveError(f"{name!r}: '..' in member paths is refused", field=name)
    return PurePosixPath(*(p for p in path.parts if p != "."))


# --- tar ------------------------------------------------------------------------------


class _BoundedReader(io.RawIOBase):
    """Reads from `source`, refusing to produce more than `limit` bytes in total."""

    def __init__(self, source: BinaryIO, *, limit: int) -> None:
        self.source = source
        self.limit = limit
        self.produced = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.source.read(len(buffer))
        self.produced += len(data)
        if self.produced > self.limit:
            raise AdapterTooLargeError(f"the archive expands past {self.limit} bytes", field="file")
        buffer[: len(data)] = data
        return len(data)


def _unpack_tar(archive: Path, dest: Path, *, limits: ArchiveLimits, gzipped: bool) -> None:
    placement = _Placement(dest, limits)
    stream_limit = limits.max_total_bytes + TAR_OVERHEAD_PER_MEMBER * (limits.max_members + 2)
    with archive.open("rb") as raw, _corrupt_as_invalid():
        source: BinaryIO = gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw
        bounded = io.BufferedReader(_BoundedReader(source, limit=stream_limit), CHUNK)
        with tarfile.open(fileobj=bounded, mode="r|") as tar:
            for member in tar:
                path = placement.count(member.name)
                if member.isdir():
                    continue
                if not member.isreg() or member.type == tarfile.GNUTYPE_SPARSE:
                    raise UnsafeArchiveError(
                        f"{member.name!r}: links, devices and other special files are refused",
                        field=member.name,
                    )
                out = placement.target(path)
                if out is None:
                    continue  # the stream skips its bytes, still counted by the reader
                placement.check_declared(member.size, member=member.name)
                extracted = tar.extractfile(member)
                assert extracted is not None  # a regular file always has a reader
                placement.copy(extracted, out, member=member.name)


# --- zip ------------------------------------------------------------------------------


def _unpack_zip(archive: Path, dest: Path, *, limits: ArchiveLimits) -> None:
    placement = _Placement(dest, limits)
    with archive.open("rb") as raw, _corrupt_as_invalid():
        entries, directory_bytes = _zip_directory_size(raw)
        if entries > limits.max_members:
            raise AdapterTooLargeError(
                f"the archive has {entries} members, over {limits.max_members}", field="file"
            )
        if directory_bytes > MAX_ZIP_DIRECTORY_BYTES:
            raise AdapterTooLargeError(
                f"the archive's directory is {directory_bytes} bytes, over "
                f"{MAX_ZIP_DIRECTORY_BYTES}",
                field="file",
            )
        with zipfile.ZipFile(raw) as zf:
            for info in zf.infolist():
                path = placement.count(info.filename)
                mode = info.external_attr >> 16
                if info.is_dir():
                    continue
                if stat.S_IFMT(mode) not in (0, stat.S_IFREG):
                    raise UnsafeArchiveError(
                        f"{info.filename!r}: links, devices and other special files are refused",
                        field=info.filename,
                    )
                if info.flag_bits & 0x1:
                    raise InvalidAdapterError(
                        f"{info.filename!r}: encrypted members are not supported",
                        field=info.filename,
                    )
                out = placement.target(path)
                if out is not None:
                    placement.check_declared(info.file_size, member=info.filename)
                    with zf.open(info) as member:
                        placement.copy(member, out, member=info.filename)


def _zip_directory_size(f: BinaryIO) -> tuple[int, int]:
    """Entries in the zip's central directory and its bytes, from its end record (zip64
    included).

    Read by hand because `zipfile.ZipFile` builds a `ZipInfo` for every entry before we could
    count them, and a small upload can declare millions.
    """
    f.seek(0, io.SEEK_END)
    file_size = f.tell()
    tail_start = max(0, file_size - (22 + 0xFFFF))
    f.seek(tail_start)
    tail = f.read()
    at = tail.rfind(ZIP_END_RECORD)
    if at < 0 or at + 22 > len(tail):
        raise InvalidAdapterError("the zip archive is truncated or corrupt", field="file")
    count = int.from_bytes(tail[at + 10 : at + 12], "little")
    size = int.from_bytes(tail[at + 12 : at + 16], "little")
    locator = at - 20
    zip64 = count == 0xFFFF or size == 0xFFFFFFFF
    if zip64 and locator >= 0 and tail[locator : locator + 4] == ZIP64_LOCATOR:
        record_offset = int.from_bytes(tail[locator + 8 : locator + 16], "little")
        f.seek(record_offset)
        record = f.read(56)
        if len(record) < 48:
            raise InvalidAdapterError("the zip archive is truncated or corrupt", field="file")
        count = int.from_bytes(record[32:40], "little")
        size = int.from_bytes(record[40:48], "little")
    f.seek(0)
    return count, size


@contextmanager
def _corrupt_as_invalid() -> Iterator[None]:
    """Library errors for damaged archives become one clear adapter error."""
    try:
        yield
    except (
        tarfile.TarError,
        zipfile.BadZipFile,
        EOFError,
        zlib.error,
        gzip.BadGzipFile,
        NotImplementedError,  # a zip compression method the standard library lacks
    ) as exc:
        raise InvalidAdapterError(
            f"the archive is truncated or corrupt ({exc})", field="file"
        ) from exc
