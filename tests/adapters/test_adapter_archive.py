"""adapters.archive: benign archives unpack to exactly the adapter's two files; hostile ones are
refused with an error naming the member, and nothing is written outside the destination."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from adapter_factories import save_adapter
from adapters import (
    AdapterTooLargeError,
    ArchiveLimits,
    InvalidAdapterError,
    UnsafeArchiveError,
    unpack_adapter_archive,
)
from archive_factories import (
    Member,
    adapter_members,
    pickle_bytes,
    tar_bytes,
    with_declared_size,
    zeros_member,
    zip64_declaring,
    zip_bytes,
)

LIMITS = ArchiveLimits(max_members=8, max_member_bytes=1 << 20, max_total_bytes=2 << 20)
FILES = ["adapter_config.json", "adapter_model.safetensors"]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("adapter")
    save_adapter(path, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return path


def unpack(tmp_path: Path, data: bytes, *, limits: ArchiveLimits = LIMITS) -> Path:
    tmp_path.mkdir(exist_ok=True)
    archive = tmp_path / "upload"
    archive.write_bytes(data)
    dest = tmp_path / "dest"
    dest.mkdir()
    unpack_adapter_archive(archive, dest, limits=limits)
    return dest


def outside_files(tmp_path: Path) -> set[str]:
    """Everything under tmp_path except the upload and the destination's own files."""
    return {
        str(p.relative_to(tmp_path))
        for p in tmp_path.rglob("*")
        if p.name != "upload" and p.parent.name != "dest" and p.name != "dest"
    }


@pytest.mark.parametrize(
    "build",
    [
        lambda ms: tar_bytes(ms),
        lambda ms: tar_bytes(ms, gzipped=False),
        zip_bytes,
    ],
    ids=["tar.gz", "tar", "zip"],
)
@pytest.mark.parametrize("folder", ["", "my-adapter", "./"])
def test_benign_archives_unpack_exactly_the_two_files(
    build, folder: str, adapter_dir: Path, tmp_path: Path
) -> None:
    extras = [Member(f"{folder}/README.md" if folder else "README.md", b"# hi")]
    if folder and folder != "./":
        extras.append(Member(folder, kind="dir"))
    dest = unpack(tmp_path, build(extras + adapter_members(adapter_dir, folder=folder)))
    assert sorted(p.name for p in dest.iterdir()) == FILES
    for name in FILES:
        assert (dest / name).read_bytes() == (adapter_dir / name).read_bytes()


@pytest.mark.parametrize("build", [tar_bytes, zip_bytes], ids=["tar.gz", "zip"])
@pytest.mark.parametrize(
    "name, reason",
    [
        ("../../evil/adapter_config.json", "'..'"),
        ("ok/../../adapter_config.json", "'..'"),
        ("/etc/adapter_config.json", "absolute"),
        ("C:/adapter_config.json", "absolute"),
        ("a\\..\\adapter_config.json", "backslash"),
    ],
)
def test_traversal_and_absolute_names_are_refused(
    build, name: str, reason: str, adapter_dir: Path, tmp_path: Path
) -> None:
    members = [Member(name, b"{}"), *adapter_members(adapter_dir)]
    with pytest.raises(UnsafeArchiveError, match=reason) as info:
        unpack(tmp_path, build(members))
    assert info.value.field == name
    assert outside_files(tmp_path) == set()


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "chardev", "fifo"])
def test_links_and_special_files_are_refused_in_tar(
    kind: str, adapter_dir: Path, tmp_path: Path
) -> None:
    members = [Member("adapter_model.safetensors", kind=kind, target="/etc/passwd")]
    members += adapter_members(adapter_dir)[:1]
    with pytest.raises(UnsafeArchiveError, match="links, devices"):
        unpack(tmp_path, tar_bytes(members))
    assert outside_files(tmp_path) == set()


@pytest.mark.parametrize("kind", ["symlink", "chardev"])
def test_links_and_special_files_are_refused_in_zip(
    kind: str, adapter_dir: Path, tmp_path: Path
) -> None:
    members = [*adapter_members(adapter_dir)[:1], Member("adapter_model.safetensors", kind=kind)]
    with pytest.raises(UnsafeArchiveError, match="links, devices"):
        unpack(tmp_path, zip_bytes(members))


@pytest.mark.parametrize("build", [tar_bytes, zip_bytes], ids=["tar.gz", "zip"])
@pytest.mark.parametrize("name", ["adapter_model.bin", "weights/model.pt", "x.ckpt"])
def test_pickles_are_refused_and_never_run(
    build, name: str, adapter_dir: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "pickle-ran"
    members = [*adapter_members(adapter_dir), Member(name, pickle_bytes(marker))]
    with pytest.raises(UnsafeArchiveError, match="pickled files are refused"):
        unpack(tmp_path, build(members))
    assert not marker.exists()


@pytest.mark.parametrize("build", [tar_bytes, zip_bytes], ids=["tar.gz", "zip"])
def test_bombs_stop_at_the_limit(build, adapter_dir: Path, tmp_path: Path) -> None:
    bomb = zeros_member("adapter_model.safetensors", 64 << 20)  # 64 MiB of zeros, ~64 KiB packed
    data = build([adapter_members(adapter_dir)[0], bomb])
    assert len(data) < 1 << 20
    with pytest.raises(AdapterTooLargeError, match="bytes"):
        unpack(tmp_path, data)


def test_skipped_members_count_toward_the_total_in_a_tar_stream(
    adapter_dir: Path, tmp_path: Path
) -> None:
    """A tar stream decompresses what it skips, so skipped bytes are bounded too; a zip
    seeks past skipped members without decompressing them, so they cost nothing."""
    filler = [zeros_member(f"junk{i}.txt", 900 << 10) for i in range(4)]  # 3.6 MiB unpacked
    with pytest.raises(AdapterTooLargeError, match="expands past"):
        unpack(tmp_path, tar_bytes(filler + adapter_members(adapter_dir)))
    dest = unpack(tmp_path / "zip", zip_bytes(filler + adapter_members(adapter_dir)))
    assert sorted(p.name for p in dest.iterdir()) == FILES


@pytest.mark.parametrize("build", [tar_bytes, zip_bytes], ids=["tar.gz", "zip"])
def test_too_many_members(build, adapter_dir: Path, tmp_path: Path) -> None:
    many = [Member(f"f{i}.txt", b"x") for i in range(20)]
    with pytest.raises(AdapterTooLargeError, match="members"):
        unpack(tmp_path, build(many + adapter_members(adapter_dir)))


@pytest.mark.parametrize("build", [tar_bytes, zip_bytes], ids=["tar.gz", "zip"])
def test_truncated_archives(build, adapter_dir: Path, tmp_path: Path) -> None:
    data = build(adapter_members(adapter_dir))
    with pytest.raises(InvalidAdapterError, match=r"truncated or corrupt|has no"):
        unpack(tmp_path, data[: len(data) * 2 // 3])


def test_not_an_archive(tmp_path: Path) -> None:
    with pytest.raises(InvalidAdapterError, match=r"not a \.tar\.gz"):
        unpack(tmp_path, b"just some text, not an archive at all")


@pytest.mark.parametrize(
    "members, message",
    [
        (lambda a: adapter_members(a)[:1], "no adapter_model.safetensors"),
        (lambda a: adapter_members(a)[1:], "no adapter_config.json"),
        (lambda a: adapter_members(a) + adapter_members(a, folder="x")[:1], "one folder"),
        (lambda a: adapter_members(a, folder="a/b"), "no adapter_config.json"),
    ],
    ids=["no-weights", "no-config", "two-folders", "too-deep"],
)
def test_the_adapter_files_must_be_there_once(
    members, message: str, adapter_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(InvalidAdapterError, match=message):
        unpack(tmp_path, tar_bytes(members(adapter_dir)))


def test_the_same_file_twice_is_refused(adapter_dir: Path, tmp_path: Path) -> None:
    twice = adapter_members(adapter_dir) + adapter_members(adapter_dir)[:1]
    with pytest.raises(InvalidAdapterError, match="twice"):
        unpack(tmp_path, tar_bytes(twice))


def forbid_zip_directory_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, fail the test if `zipfile` opens an archive to read its directory (an
    object per entry it declares: what a refusal on the end record alone avoids)."""

    def read_directory(*args, **kwargs):
        raise AssertionError("zipfile.ZipFile read the directory before the refusal")

    monkeypatch.setattr(zipfile, "ZipFile", read_directory)


def test_a_zip_declaring_millions_of_entries_is_refused_before_reading_them(
    adapter_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = bytearray(zip_bytes(adapter_members(adapter_dir)))
    end = data.rfind(b"PK\x05\x06")
    data[end + 8 : end + 12] = (0xFFFE).to_bytes(2, "little") * 2  # entries on disk / total
    forbid_zip_directory_reads(monkeypatch)
    with pytest.raises(AdapterTooLargeError, match="65534 members"):
        unpack(tmp_path, bytes(data))


def test_a_zip64_declaring_a_million_entries_is_refused_before_reading_them(
    adapter_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = zip64_declaring(zip_bytes(adapter_members(adapter_dir)), entries=10**6)
    forbid_zip_directory_reads(monkeypatch)
    with pytest.raises(AdapterTooLargeError, match="1000000 members, over 8"):
        unpack(tmp_path, data)


def test_a_zip_declaring_a_huge_directory_is_refused(adapter_dir: Path, tmp_path: Path) -> None:
    data = zip64_declaring(
        zip_bytes(adapter_members(adapter_dir)), entries=2, directory_bytes=1 << 40
    )
    with pytest.raises(AdapterTooLargeError, match="directory is 1099511627776 bytes"):
        unpack(tmp_path, data)


def test_declared_sizes_are_refused_before_decompressing(adapter_dir: Path, tmp_path: Path) -> None:
    config, weights = adapter_members(adapter_dir)
    honest_bomb = with_declared_size(zip_bytes([config, weights]), weights.name, 3 << 30)
    with pytest.raises(AdapterTooLargeError, match=r"declares 3221225472 bytes uncompressed"):
        unpack(tmp_path / "zip", honest_bomb)
    big = zeros_member("adapter_model.safetensors", (1 << 20) + 1)
    with pytest.raises(AdapterTooLargeError, match=r"declares 1048577 bytes uncompressed"):
        unpack(tmp_path / "tar", tar_bytes([config, big]))
    # Two members, each under the member bound, declaring more than the total together.
    limits = ArchiveLimits(max_members=8, max_member_bytes=1 << 20, max_total_bytes=1 << 20)
    halves = [zeros_member("adapter_config.json", 600 << 10), zeros_member(weights.name, 600 << 10)]
    with pytest.raises(AdapterTooLargeError, match="members declare over 1048576 bytes"):
        unpack(tmp_path / "total", zip_bytes(halves), limits=limits)


def test_a_lying_declared_size_still_stops_at_the_limit(adapter_dir: Path, tmp_path: Path) -> None:
    config, _ = adapter_members(adapter_dir)
    bomb = zeros_member("adapter_model.safetensors", 4 << 20)
    liar = with_declared_size(zip_bytes([config, bomb]), bomb.name, 100)
    with pytest.raises((AdapterTooLargeError, InvalidAdapterError)):
        unpack(tmp_path, liar)
    assert not (tmp_path / "dest" / bomb.name).exists() or (
        (tmp_path / "dest" / bomb.name).stat().st_size <= LIMITS.max_member_bytes
    )
