"""GGUF file -> (ModelConfig, HF-named float tensors), dequantized on load with the ``gguf`` package.

llama.cpp's converter permutes the rows of q/k projection weights of llama-architecture models for its
interleaved RoPE layout; this loader undoes that permutation so the weights are in Hugging Face (neox
rotate-half) layout.  Nothing in the file is executed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from kvbench.runtime.models.config import ModelConfig

__all__ = ["read_gguf_metadata", "gguf_config", "load_gguf", "load_gguf_cached", "read_safetensors"]

_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}
_PERMUTED = ("llama", "mistral")  # q/k rows permuted by llama.cpp's converter

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's four norms per layer (``ffn_norm`` is the norm before the MLP, as in llama, but a second pair follows)
_GEMMA_LAYER_MAP = {
    **_LAYER_MAP,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def read_gguf_metadata(path: str | Path) -> dict:
    """Scalar/string/list metadata of a GGUF file (token lists included), as plain Python values."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    out = {}
    for k, f in r.fields.items():
        try:
            out[k] = f.contents()
        except Exception:  # unknown field layouts are not needed
            continue
    return out


def gguf_config(meta: dict) -> ModelConfig:
    arch = meta.get("general.architecture")
    experts = meta.get(f"{arch}.expert_count") or 0
    if experts or str(arch).endswith("moe"):
        from kvbench.runtime.models.gemma3_config import EXTERNAL_HINT

        raise ValueError(f"GGUF architecture {arch!r} is a mixture-of-experts model (expert_count={experts}): the "
                         f"embedded engine runs dense decoders only; {EXTERNAL_HINT}")
    if arch == "gemma3":
        from kvbench.runtime.models.gemma3_config import gemma3_from_gguf

        return gemma3_from_gguf(meta)
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHS)}")

    def g(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    head_dim = int(g("attention.key_length", hidden // heads))
    vocab = int(g("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])) or 0))  # 0: from the embedding
    scaling = None
    if g("rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": g("rope.scaling.type"), "factor": float(g("rope.scaling.factor", 1.0))}
        if g("rope.scaling.original_context_length"):
            scaling["original_max_position_embeddings"] = int(g("rope.scaling.original_context_length"))
    window = g("attention.sliding_window")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        arch=_ARCHS[arch],
        hidden_size=hidden,
        num_layers=int(g("block_count")),
        num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(g("feed_forward_length")),
        vocab_size=vocab,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rotary_dim=int(g("rope.dimension_count")) if g("rope.dimension_count") and int(g("rope.dimension_count")) != head_dim else None,
        max_position_embeddings=int(g("context_length", 4096)),
        qkv_bias=_ARCHS[arch] == "qwen2",
        qk_norm=_ARCHS[arch] == "qwen3",
        sliding_windows=[int(window)] * int(g("block_count")) if window else [],
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
    )


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``permute``: rows ``[h, d/2, 2]`` -> ``[h, 2, d/2]``."""
    rows = w.shape[0]
    d = rows // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Config, HF-named tensors (dequantized to ``dtype``) and the raw metadata of a GGUF file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    r = GGUFReader(str(path))
    meta = {}
    for k, f in r.fields.items():
        if k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            continue  # large lists, read by the tokenizer loader
        try:
            meta[k] = f.contents()
        except Exception:
            continue
    cfg = gguf_config(meta)
    state: dict[str, torch.Tensor] = {}
    layer_map = _GEMMA_LAYER_MAP if cfg.arch == "gemma3" else _LAYER_MAP
    for t in r.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if m:
            sub = layer_map.get(m.group(2))
            name = f"model.layers.{m.group(1)}.{sub}" if sub else None
        else:
            name = _GLOBAL_MAP.get(t.name)
        if name is None:
            if t.name.startswith("rope_"):  # precomputed rope factors: not used
                continue
            raise ValueError(f"unexpected tensor {t.name!r} in {path.name}")
        arr = dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims fastest-first
        ten = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))
        if cfg.arch in _PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            ten = _unpermute(ten, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        if cfg.norm_plus_one and name.endswith("norm.weight"):
            ten = ten - 1.0  # llama.cpp stores Gemma's norm weights as 1 + w
        state[name] = ten.to(dtype)
    cfg.tie_word_embeddings = "lm_head.weight" not in state
    if cfg.vocab_size == 0:
        cfg.vocab_size = state["model.embed_tokens.weight"].shape[0]
    return cfg, state, meta


def load_gguf_cached(path: str | Path, dtype: torch.dtype = torch.float32,
                     on_part: Optional[Callable[[str], None]] = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``load_gguf`` with the dequantized float32 tensors kept as safetensors in the cache directory
    (keyed by the file's path, size and mtime), since parsing and dequantizing a GGUF is slow.
    ``on_part(text)``: told which of the two it does ("reading the dequantized cache" / "dequantizing")."""
    on_part = on_part or (lambda _text: None)
    import dataclasses
    import hashlib
    import json
    import os

    from safetensors.torch import save_file

    from kvbench.runtime.default_model import cache_dir

    path = Path(path)
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    d = cache_dir() / "weights" / key
    if (d / "config.json").is_file() and (d / "model.safetensors").is_file():
        on_part("reading the dequantized cache")
        try:
            cfg = ModelConfig(**json.loads((d / "config.json").read_text()))
            # read into fresh memory, not a file mapping: page faults on mapped weights slow every matmul, and
            # mapped pages next to a copy would double the load's peak RSS
            return cfg, read_safetensors(d / "model.safetensors", dtype)
        except Exception:  # damaged cache entry: rebuild below
            pass
    on_part("dequantizing")
    cfg, state, _meta = load_gguf(path, torch.float32)
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"model.safetensors.tmp{os.getpid()}"
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
        os.replace(tmp, d / "model.safetensors")
        tmpc = d / f"config.json.tmp{os.getpid()}"
        tmpc.write_text(json.dumps(dataclasses.asdict(cfg)))
        os.replace(tmpc, d / "config.json")
    except OSError:  # the cache is an optimisation only
        pass
    return cfg, {k: v.to(dtype) for k, v in state.items()}


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8}


def read_safetensors(path: str | Path, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, read one by one with plain reads into memory of their own (no
    mapping of the file, so the load's peak is one copy of the weights plus one tensor); floating tensors
    converted to ``dtype`` when given.  Nothing in the file is executed (a JSON header and raw bytes)."""
    import json
    import struct

    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _ST_DTYPES:
                raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, not one of {', '.join(_ST_DTYPES)}")
            start, end = info["data_offsets"]
            t = torch.empty(info["shape"], dtype=_ST_DTYPES[info["dtype"]])
            buf = memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
            if len(buf) != end - start:
                raise ValueError(f"{path}: tensor {name} holds {end - start} bytes for shape {info['shape']}")
            f.seek(8 + n + start)
            got = 0
            while got < len(buf):
                k = f.readinto(buf[got:])
                if not k:
                    raise ValueError(f"{path}: truncated at tensor {name}")
                got += k
            out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out
