"""The fidelity reference cache key (suites/fidelity/cache.py, harness/fidelity_key.py, core/model_identity.py):
a model rewritten at the same path is a miss that says why, logits-changing engine settings are misses,
scheduling-only settings and concurrency are hits, and the size cap evicts least recently used entries."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from kvbench.core.model_identity import describe_change, file_fingerprint, hf_dir_identity, model_identity
from kvbench.harness.fidelity_key import embedded_reference_key, server_reference_key
from kvbench.runtime.config import EngineConfig
from kvbench.suites.base import SuiteOptions
from kvbench.suites.fake import FakeClient
from kvbench.suites.fidelity.suite import FidelitySuite, Reference
from kvbench.suites.fidelity.cache import MAX_MB_ENV, ReferenceCache, entry_key
from kvbench.suites.fidelity.ref import RefText, Text

MB = 2**20


def _texts(opts):
    return [Text(f"t{i}", f"Question: item {i}?\nAnswer:", f" the answer is {i} and {i + 1}.") for i in range(3)]


def _write(path: Path, seed: int, size: int = 6 * MB, keep_mtime_of: Path | None = None) -> None:
    st = keep_mtime_of.stat() if keep_mtime_of is not None else None
    path.write_bytes(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())
    if st is not None:  # same size and modification time: only the content hash can tell
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


class Counting:
    """A reference client factory that counts how often the reference had to be computed."""

    def __init__(self):
        self.made = 0

    def __call__(self):
        self.made += 1
        return FakeClient(seed=0)


def _run(cache: Path, key, factory: Counting):
    suite = FidelitySuite(Reference("ref-label", factory, key), cache, top_k=8, greedy_tokens=4, texts=_texts)
    return suite.run(FakeClient(seed=0), SuiteOptions(progress=False, concurrency=2))


# ------------------------------------------------------------------------------------------- model identity
def test_gguf_rewritten_at_the_same_path_rebuilds_the_reference(tmp_path, caplog):
    model = tmp_path / "model.gguf"
    _write(model, seed=1)
    key = lambda: embedded_reference_key(EngineConfig(model=str(model), device="cpu")).to_dict()  # noqa: E731
    refs = Counting()
    _run(tmp_path / "cache", key, refs)
    _run(tmp_path / "cache", key, refs)
    assert refs.made == 1  # the second run read the cache
    _write(model, seed=2, keep_mtime_of=model)  # "re-quantized" in place: same size, same mtime
    with caplog.at_level(logging.INFO, logger="kvbench.suites.fidelity.suite"):
        _run(tmp_path / "cache", key, refs)
    assert refs.made == 2, "a rewritten model file must not reuse the cached reference"
    assert any("model file changed since the cached reference" in r.getMessage() and "content hash changed" in r.getMessage()
               for r in caplog.records)
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1  # the stale entry is gone
    meta = next((tmp_path / "cache").glob("*.json")).read_text()
    assert str(model.resolve()) in meta and '"sha256"' in meta  # the identity is in the entry's meta


def test_file_fingerprint_reads_a_sample_not_the_whole_file(tmp_path):
    f = tmp_path / "big.gguf"
    _write(f, seed=3, size=40 * MB)
    fp = file_fingerprint(f)
    assert fp["size"] == 40 * MB and fp["hashed_bytes"] < 6 * MB
    with open(f, "r+b") as h:  # one byte inside a sampled chunk of the tensor data
        h.seek(fp["size"] - 10)
        h.write(b"\x00" if h.read(1) != b"\x00" else b"\x01")
    again = file_fingerprint(f)
    assert again["sha256"] != fp["sha256"]
    assert "content hash changed" in describe_change(fp, again)


def test_hf_directory_identity_covers_config_tokenizer_and_safetensors(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text('{"hidden_size": 8}')
    (d / "tokenizer.json").write_text('{"model": {}}')
    header = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\x00" * 16)
    base = hf_dir_identity(d)
    assert set(base["files"]) == {"config.json", "tokenizer.json", "model.safetensors"}
    (d / "config.json").write_text('{"hidden_size": 9}')
    changed = hf_dir_identity(d)
    assert changed != base and "config.json" in describe_change(base, changed)


def test_hub_id_is_its_resolved_local_snapshot(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    from kvbench.harness.fidelity_key import local_model_identity

    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny"
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    (snap / "config.json").write_text('{"hidden_size": 8}')
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local acme/tiny directory
    ident = local_model_identity("acme/tiny")
    assert ident["kind"] == "hf" and ident["hub_id"] == "acme/tiny" and sha in ident["path"]
    assert "config.json" in ident["files"]


def test_synthetic_identity_is_shape_and_seed():
    a = embedded_reference_key(EngineConfig(model="synthetic:llama-3.2-1b,layers=2", device="cpu")).model
    assert a["kind"] == "synthetic" and a["seed"] == 0 and a["shape"]["hidden_size"] == 2048
    assert embedded_reference_key(EngineConfig(model="synthetic:llama-3.2-1b,layers=2", device="cpu", seed=1)).model != a
    assert model_identity("synthetic", "synthetic:x", seed=0, shape={"n": 1}) != model_identity("synthetic", "synthetic:x", 0, {"n": 2})


# ------------------------------------------------------------------------------------------- engine settings
def _key(**kw):
    return embedded_reference_key(EngineConfig(model="synthetic:llama-3.2-1b,layers=1", **kw)).to_dict()


def test_logits_changing_settings_miss_scheduling_settings_hit(tmp_path):
    refs = Counting()
    cache = tmp_path / "cache"
    _run(cache, _key(device="cpu", max_running=64, max_num_batched_tokens=2048, kv_budget_gb=1.0), refs)
    _run(cache, _key(device="cpu", max_running=2, max_num_batched_tokens=512, kv_budget_gb=0.1, max_model_len=512,
                     served_model_name="x"), refs)
    assert refs.made == 1  # scheduling, sizing and naming do not change logits: a hit
    _run(cache, _key(device=None, dtype="float32"), refs)  # resolved: the same device type and compute dtype
    assert refs.made == 1
    for changed in ({"dtype": "bfloat16"}, {"kv_layout": "NHD"}, {"page_size": 32}, {"fused_append": False}):
        before = refs.made
        _run(cache, _key(device="cpu", **changed), refs)
        assert refs.made == before + 1, f"{changed} changes logits: must be a miss"


def test_sweep_reference_key_ignores_concurrency(tmp_path):
    from kvbench.harness.fidelity_refs import FidelityRefs
    from kvbench.harness.matrix import expand
    from kvbench.harness.sweep.config import parse_config

    cfg = parse_config({"model": "synthetic:llama-3.2-1b,layers=1", "engine": {"device": "cpu"},
                        "axes": {"kv": ["bf16", "fp8_e4m3"], "concurrency": [1, 4]},
                        "accuracy_concurrency": 1, "suites": [{"name": "fidelity", "limit": 1}], "aa_control": False})
    refs = FidelityRefs(cfg, tmp_path / "fidelity", opener=None)
    cells = expand(cfg)
    session = type("S", (), {"info": {}, "client": None, "model_id": "m"})()
    keys = {FidelityRefs.for_cell(refs, c, session).key()["settings"]["kv_dtype"] for c in cells}
    assert keys == {"bf16"}
    all_keys = [FidelityRefs.for_cell(refs, c, session).key() for c in cells]
    assert all(k == all_keys[0] for k in all_keys)
    texts = _texts(None)
    base = entry_key(all_keys[0], texts, 8, 4)
    assert entry_key(all_keys[-1], texts, 8, 4) == base


def test_server_key_holds_the_served_model_and_a_local_model_path(tmp_path):
    from kvbench.harness.sweep.specs import TargetSpec

    model = tmp_path / "m.gguf"
    _write(model, seed=4, size=MB)
    spec = TargetSpec(name="vllm", type="endpoint", base_url="http://127.0.0.1:9", model_id="served")
    cell = {"model": str(model), "prefill_backend": "x", "decode_backend": "x", "kv_dtype": "bf16", "kv_scales": "unit"}
    k1 = server_reference_key(spec, cell, "served", None)
    assert k1.model["model_id"] == "served" and k1.model["local"]["size"] == MB
    _write(model, seed=5, size=MB, keep_mtime_of=model)
    assert server_reference_key(spec, cell, "served", None).model != k1.model
    assert server_reference_key(spec, cell, "other-id", None).model["model_id"] == "other-id"


# ------------------------------------------------------------------------------------------- size cap
def _refs(n_tokens: int, k: int = 64) -> list[RefText]:
    rng = np.random.default_rng(n_tokens)
    return [RefText("t0", np.arange(n_tokens), rng.standard_normal(n_tokens), rng.integers(0, 50000, (n_tokens, k)),
                    rng.standard_normal((n_tokens, k)), [1, 2], "ab")]


def test_size_cap_evicts_least_recently_used(tmp_path, monkeypatch):
    cache = ReferenceCache(tmp_path, max_bytes=None)
    keys = [entry_key(f"label-{i}", _texts(None), 64, 4) for i in range(4)]
    for i, k in enumerate(keys):
        cache.save(k, _refs(2000), {})
        t = 1_000_000 + i * 10
        os.utime(tmp_path / f"{k.name}.json", (t, t))
    one = cache.entries()[0][1]
    assert cache.load(keys[0]) is not None  # a hit: keys[0] is now the most recently used
    cache.max_bytes = int(2.5 * one)
    removed = cache.enforce_cap(keep=keys[3].name)
    assert set(removed) == {keys[1].name, keys[2].name}
    assert sorted(n for _, _, n in cache.entries()) == sorted([keys[0].name, keys[3].name])
    assert not list(tmp_path.glob(f"{keys[1].name}.*"))  # both files of an evicted entry are gone


def test_size_cap_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(MAX_MB_ENV, "0.001")  # 1 KiB: smaller than one entry
    refs = Counting()
    suite = FidelitySuite(Reference("a", refs), tmp_path, top_k=8, greedy_tokens=4, texts=_texts)
    suite.run(FakeClient(seed=0), SuiteOptions(progress=False))
    FidelitySuite(Reference("b", refs), tmp_path, top_k=8, greedy_tokens=4, texts=_texts).run(FakeClient(seed=0), SuiteOptions(progress=False))
    assert len(list(tmp_path.glob("*.json"))) == 1  # "a" evicted when "b" was written; "b" kept
    monkeypatch.setenv(MAX_MB_ENV, "lots")
    from kvbench.suites.base import SuiteError

    with pytest.raises(SuiteError, match=MAX_MB_ENV):
        FidelitySuite(Reference("c", refs), tmp_path, top_k=8, greedy_tokens=4, texts=_texts).run(FakeClient(seed=0), SuiteOptions(progress=False))


def test_an_entry_evicted_under_a_reader_is_a_miss(tmp_path):
    cache = ReferenceCache(tmp_path)
    k = entry_key("x", _texts(None), 8, 4)
    cache.save(k, _refs(10, 8), {})
    (tmp_path / f"{k.name}.npz").unlink()  # an eviction removes the meta first; a torn pair reads as absent
    assert cache.load(k) is None
