"""adapters/store: content-addressed adapter storage; and adapters/ never imports torch."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adapter_factories import (
    LIMITS,
    peft_magnitudes,
    peft_reference,
    peft_saved,
    peft_tokens,
    reload_peft,
    save_adapter,
    tiny_spec,
)
from adapters import (
    AdapterNotFoundError,
    FilesystemAdapterStore,
    InvalidAdapterIdError,
    LoraAdapter,
    load_adapter_dir,
)

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


def load(path: Path) -> LoraAdapter:
    return load_adapter_dir(path, base=tiny_spec(), **LIMITS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("saved") / "adapter"
    save_adapter(path, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    return path


@pytest.fixture
def store(tmp_path: Path) -> FilesystemAdapterStore:
    return FilesystemAdapterStore(tmp_path / "store")


def test_put_get_list_delete_round_trip(saved: Path, store: FilesystemAdapterStore) -> None:
    adapter = load(saved)
    assert store.list() == []
    assert store.put(adapter) == adapter.id
    assert store.exists(adapter.id)
    assert store.list() == [adapter.id]
    path = store.get(adapter.id)
    assert sorted(p.name for p in path.iterdir()) == ADAPTER_FILES
    stored = load(path)
    assert stored.id == adapter.id
    for key, w in adapter.weights.items():
        np.testing.assert_array_equal(stored.weights[key].a, w.a)
        np.testing.assert_array_equal(stored.weights[key].b, w.b)
        assert stored.weights[key].scaling == w.scaling

    assert store.delete(adapter.id) is True
    assert not store.exists(adapter.id)
    assert store.list() == []
    with pytest.raises(AdapterNotFoundError, match=f"adapter {adapter.id} is not in the store"):
        store.get(adapter.id)
    assert store.delete(adapter.id) is False
    assert sorted(os.listdir(store.root)) == []  # no staging or trash left behind


def test_put_is_idempotent_and_deterministic(saved: Path, tmp_path: Path) -> None:
    adapter = load(saved)
    store = FilesystemAdapterStore(tmp_path / "one")
    store.put(adapter)
    files = {name: (store.get(adapter.id) / name).stat().st_mtime_ns for name in ADAPTER_FILES}
    assert store.put(load(saved)) == adapter.id  # again: nothing rewritten
    assert {n: (store.get(adapter.id) / n).stat().st_mtime_ns for n in ADAPTER_FILES} == files
    assert os.listdir(store.root) == [adapter.id]
    other = FilesystemAdapterStore(tmp_path / "two")
    other.put(adapter)
    for name in ADAPTER_FILES:  # the canonical form is a function of the adapter
        assert (other.get(adapter.id) / name).read_bytes() == (
            store.get(adapter.id) / name
        ).read_bytes()


def test_put_loses_a_race_gracefully(
    saved: Path, store: FilesystemAdapterStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer renames the same id into place first: put still succeeds, cleanly."""
    adapter = load(saved)
    real_rename = os.rename

    def rename_after_a_rival(src: Path, dst: Path) -> None:
        rival = FilesystemAdapterStore(store.root)
        monkeypatch.setattr("adapters.stores.filesystem.os.rename", real_rename)
        rival.put(adapter)
        real_rename(src, dst)  # fails: dst now exists and is not empty

    monkeypatch.setattr("adapters.stores.filesystem.os.rename", rename_after_a_rival)
    assert store.put(adapter) == adapter.id
    assert os.listdir(store.root) == [adapter.id]
    assert load(store.get(adapter.id)).id == adapter.id


STORED_CASES = {
    "rank and alpha patterns": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ALL_SEVEN,
        "rank_pattern": {"v_proj": 2, "layers.1.mlp.up_proj": 6},
        "alpha_pattern": {"o_proj": 3},
    },
    "use_rslora": {"r": 8, "lora_alpha": 16, "use_rslora": True, "target_modules": ["q_proj"]},
    "layers_to_transform": {"r": 2, "target_modules": ["k_proj"], "layers_to_transform": [1]},
    "use_dora": {"r": 4, "target_modules": ["q_proj", "down_proj"], "use_dora": True},
    "modules_to_save": {"r": 2, "target_modules": ["v_proj"], "modules_to_save": ["lm_head"]},
    "trainable_token_indices": {
        "r": 2,
        "target_modules": ["q_proj"],
        "trainable_token_indices": [9, 4, 100],
    },
}


@pytest.mark.parametrize("lora", STORED_CASES.values(), ids=STORED_CASES.keys())
def test_stored_adapter_is_a_plain_peft_adapter(
    lora: dict[str, Any], store: FilesystemAdapterStore, tmp_path: Path
) -> None:
    """PEFT loads the canonical directory and computes exactly what the original did."""
    original = save_adapter(tmp_path / "original", **lora)
    adapter_id = store.put(load(tmp_path / "original"))
    expected = peft_reference(original)
    reloaded = reload_peft(store.get(adapter_id))
    served = peft_reference(reloaded)
    assert served.keys() == expected.keys()
    for key, (a, b, scaling) in expected.items():
        np.testing.assert_array_equal(served[key][0], a)
        np.testing.assert_array_equal(served[key][1], b)
        assert served[key][2] == scaling, key
    magnitudes, served_magnitudes = peft_magnitudes(original), peft_magnitudes(reloaded)
    assert served_magnitudes.keys() == magnitudes.keys()  # empty but for DoRA
    for key, magnitude in magnitudes.items():
        np.testing.assert_array_equal(served_magnitudes[key], magnitude)
    copies, served_copies = peft_saved(original), peft_saved(reloaded)
    assert served_copies.keys() == copies.keys()  # empty but for modules_to_save
    for module, copy in copies.items():
        np.testing.assert_array_equal(served_copies[module], copy)
    if "trainable_token_indices" in lora:
        tokens, served_tokens = peft_tokens(original), peft_tokens(reloaded)
        assert served_tokens.keys() == tokens.keys()
        for token, row in tokens.items():
            np.testing.assert_array_equal(served_tokens[token], row)


@pytest.mark.parametrize(
    "bad_id", ["", "../x", "../" + "0" * 61, "abc", "0" * 63, "0" * 65, "A" * 64, "g" * 64, None]
)
def test_malformed_ids_are_refused(bad_id: Any, store: FilesystemAdapterStore) -> None:
    for operation in (store.get, store.exists, store.delete):
        with pytest.raises(InvalidAdapterIdError, match="is not 64 lowercase hex digits"):
            operation(bad_id)


def test_permissions(saved: Path, tmp_path: Path) -> None:
    store = FilesystemAdapterStore(tmp_path / "deep" / "store")
    path = store.get(store.put(load(saved)))

    def mode(p: Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    assert (mode(store.root), mode(path)) == (0o750, 0o750)
    assert {mode(path / name) for name in ADAPTER_FILES} == {0o640}
    open_root = tmp_path / "open"
    open_root.mkdir()
    open_root.chmod(0o777)
    with pytest.raises(PermissionError, match="world-writable"):
        FilesystemAdapterStore(open_root)


def test_adapters_never_import_torch(saved: Path, tmp_path: Path) -> None:
    """The gateway imports adapters/ to validate uploads; it must stay free of torch/triton."""
    root = Path(__file__).resolve().parents[2]
    modules = sorted(p.stem for p in (root / "adapters").glob("*.py") if p.stem != "__init__")
    script = textwrap.dedent(f"""
        import sys
        import adapters
        {"; ".join(f"import adapters.{m}" for m in modules)}
        from adapters import BaseModelSpec, FilesystemAdapterStore, load_adapter_dir
        spec = BaseModelSpec(model_type="llama", num_layers=2, hidden_size=64,
            intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128)
        adapter = load_adapter_dir({str(saved)!r}, base=spec, max_lora_rank=8, max_bytes=1 << 20)
        FilesystemAdapterStore({str(tmp_path / "store")!r}).put(adapter)
        leaked = sorted(m for m in ("torch", "triton") if m in sys.modules)
        assert not leaked, leaked
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert len(modules) >= 8, modules


def test_replicas_creating_the_root_at_once_all_succeed(tmp_path: Path) -> None:
    """Gateway replicas starting together on a fresh shared volume race to create it."""
    import threading

    root = tmp_path / "shared" / "store"
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def open_store() -> None:
        barrier.wait()
        try:
            FilesystemAdapterStore(root)
        except BaseException as exc:  # collected, asserted below
            errors.append(exc)

    threads = [threading.Thread(target=open_store) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and root.is_dir()


# --- adopting staged blobs, setting aside, stale entries --------------------------------


def staged_copy(adapter: LoraAdapter, store: FilesystemAdapterStore, name: str) -> Path:
    from adapters.store import write_staged

    staged = store.root / f".upload-{name}"
    staged.mkdir()
    write_staged(adapter, staged)
    return staged


def test_adopt_moves_a_staged_blob_in_once(saved: Path, store: FilesystemAdapterStore) -> None:
    adapter = load(saved)
    first, second = staged_copy(adapter, store, "a"), staged_copy(adapter, store, "b")
    assert store.adopt(adapter.id, first) is True and not first.exists()
    assert load(store.get(adapter.id)).id == adapter.id
    old = 1_000_000_000
    os.utime(store.get(adapter.id), (old, old))
    # Already there: the staged copy stays with the caller, and the blob's mtime is renewed.
    assert store.adopt(adapter.id, second) is False and second.exists()
    assert store.get(adapter.id).stat().st_mtime > old


def test_set_aside_and_restore(saved: Path, store: FilesystemAdapterStore) -> None:
    adapter = load(saved)
    store.put(adapter)
    aside = store.set_aside(adapter.id)
    assert aside is not None and not store.exists(adapter.id) and store.list() == []
    assert store.set_aside(adapter.id) is None  # nothing left to set aside
    store.restore(adapter.id, aside)
    assert store.exists(adapter.id) and not aside.exists()
    # An upload re-adopted the id while it was aside: that copy stays, the old one goes.
    aside = store.set_aside(adapter.id)
    assert store.adopt(adapter.id, staged_copy(adapter, store, "c")) is True
    store.restore(adapter.id, aside)
    assert store.exists(adapter.id) and not aside.exists()


def test_stale_entries_are_old_leftovers_and_blobs(
    saved: Path, store: FilesystemAdapterStore
) -> None:
    adapter = load(saved)
    store.put(adapter)
    for name in (".upload-x", ".tmp-x", ".trash-x", "notes"):
        (store.root / name).mkdir()
    now = store.get(adapter.id).stat().st_mtime
    leftovers, blobs = store.stale_entries(grace_s=60, now=now + 30)
    assert leftovers == [] and blobs == []  # all younger than the grace period
    leftovers, blobs = store.stale_entries(grace_s=60, now=now + 120)
    assert sorted(p.name for p in leftovers) == [".tmp-x", ".trash-x", ".upload-x"]
    assert blobs == [adapter.id]  # "notes" is neither: never touched
