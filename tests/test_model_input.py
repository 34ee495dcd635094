"""--model input: check_model_ref refuses path-looking references that name nothing (before anything loads);
hub ids come from the local hub cache (or a download) and, when they cannot, say how to give a local copy."""

from __future__ import annotations

import json

import pytest

from kvbench.harness.errors import UserError
from kvbench.harness.model_input import check_model_ref, looks_like_path
from kvbench.runtime.models.hub import hub_snapshot, is_hub_id


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty HF hub cache, offline: nothing touches the network."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _cached_repo(cache, repo_id: str) -> str:
    """A snapshot laid out as huggingface_hub stores one (refs/main -> snapshots/<rev>/config.json)."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo_id.replace('/', '--')}"
    snap = root / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(rev)
    return str(snap)


@pytest.mark.parametrize("ref", ["./missing-model", "/nonexistent/model", "~/no-such-kvbench-model", "model.gguf",
                                 "Some.GGUF", "a/b/c", "dir\\x/y"])
def test_path_looking_refs_that_do_not_exist_are_user_errors(ref, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"^--model .*: no such file or directory$"):
        check_model_ref(ref)


@pytest.mark.parametrize("ref", [None, "smollm2-135m", "default", "synthetic:tiny", "meta-llama/Llama-3.1-8B"])
def test_presets_synthetic_and_hub_ids_pass(ref, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert check_model_ref(ref) is None


def test_existing_paths_pass_and_bad_ones_say_why(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    check_model_ref(str(hf))
    check_model_ref(str(gguf))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="neither config.json"):
        check_model_ref(str(empty))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(UserError, match="must be a .gguf"):
        check_model_ref(str(other))


def test_hub_id_shape():
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("meta-llama/Llama-3.1-8B")
    assert not is_hub_id("./x/y") and not is_hub_id("/a/b") and not is_hub_id("a/b.gguf") and not is_hub_id("a/b/c")
    assert not is_hub_id("smollm2-135m") and not is_hub_id("../b")
    assert looks_like_path("a/b/c") and not looks_like_path("Qwen/Qwen3-8B") and looks_like_path("x.gguf")


def test_hub_id_offline_not_cached_says_how_to_get_a_local_copy(offline_cache):
    with pytest.raises(UserError) as e:
        check_model_ref("acme/missing-model")
    msg = str(e.value)
    assert "huggingface-cli download acme/missing-model --local-dir DIR" in msg and "--model DIR" in msg
    assert "HF_HOME" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="huggingface-cli download acme/missing-model"):
        hub_snapshot("acme/missing-model")


def test_hub_id_from_the_local_cache(offline_cache):
    snap = _cached_repo(offline_cache, "acme/tiny")
    check_model_ref("acme/tiny")  # offline but cached: fine
    assert hub_snapshot("acme/tiny") == snap


def test_loader_resolves_a_cached_hub_id(offline_cache):
    from kvbench.runtime.models.loader import resolve_model

    from kvbench.runtime.models.loader import _display_id

    snap = _cached_repo(offline_cache, "acme/tiny")
    assert resolve_model("acme/tiny") == ("hf", snap)
    assert _display_id("acme/tiny", "hf", snap) == "acme/tiny"  # served under its hub id, not the snapshot hash
    with pytest.raises(ValueError, match="cannot resolve model '/nonexistent/model'"):
        resolve_model("/nonexistent/model")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set; download it"):
        resolve_model("acme/other")
