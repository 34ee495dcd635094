"""Tiny random-weight checkpoints of the model families the embedded engine loads, written by transformers
itself (``save_pretrained``) or as GGUF files laid out as llama.cpp's converter lays them out, and the
parity check of the engine against transformers (float32) on them.  Helpers for the family tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-6)

HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def write_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer (``t0`` .. ``t{vocab-1}``) so the directory loads as a whole model; the tests
    feed token ids, the tokenizer only has to exist."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(path))


def save_tiny(path: Path, arch: str, extra: Optional[dict] = None, seed: int = 0, tokenizer: bool = True, post=None):
    """A random ``arch`` checkpoint (float32, eval mode) saved into ``path``; norms and biases are perturbed
    so they matter, and the weights are wide enough that greedy choices are not near-ties.  ``post(hf)``
    adjusts the weights (under no_grad) before they are saved."""
    import transformers

    cls_cfg, cls_model = HF_CLASSES[arch]
    torch.manual_seed(seed)
    kw = {**TINY, "initializer_range": 0.1, **(extra or {})}
    cfg = getattr(transformers, cls_cfg)(**kw)
    hf = getattr(transformers, cls_model)(cfg).eval().float()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
        if post is not None:
            post(hf)
    hf.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        write_tokenizer(path, kw["vocab_size"])
    return hf


def prompts(vocab: int, lengths=(23, 9, 17), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Greedy continuation by transformers, one full forward per token (no cache: nothing but the model)."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@torch.no_grad()
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def gguf_loaded(path: Path):
    """A ``LoadedModel`` of a GGUF file written by ``write_gguf`` (which carries no vocabulary: byte tokens)."""
    from kvbench.runtime.models.gguf_loader import load_gguf
    from kvbench.runtime.models.hf_loader import CheckpointScales
    from kvbench.runtime.models.loader import LoadedModel, model_class
    from kvbench.runtime.models.synthetic import ByteTokenizer

    cfg, state, _meta = load_gguf(path)
    model = model_class(cfg).from_state(cfg, state, "cpu", torch.float32).eval()
    model.bind()
    return LoadedModel(Path(path).stem, cfg, model, ByteTokenizer(cfg.vocab_size), CheckpointScales(cfg.num_layers), "gguf")


def engine(model, backend: str = "torch", **kw):
    """An engine on ``model``: a path (loaded as the command line loads it) or a ``LoadedModel``."""
    from kvbench.runtime.config import EngineConfig
    from kvbench.runtime.engine import Engine

    loaded = None if isinstance(model, str) else model
    if loaded is not None:
        model = None

    kw.setdefault("kv_budget_gb", 0.01)
    kw.setdefault("kv_dtype", "fp16")
    kw.setdefault("page_size", 4)
    kw.setdefault("max_num_batched_tokens", 16)  # prompts arrive as chunked prefills over cached prefixes
    kw.setdefault("decode_backend", backend)  # ``backend`` in both phases unless a decode backend is named
    return Engine(EngineConfig(model=model, prefill_backend=backend, **kw), loaded=loaded)


def mixed_vs_separate(model, backend: str, ps: list, params, watch=None, check=None) -> dict:
    """``ps`` generated on an engine of separate prefill / decode steps and on one with ``mixed_prefill``
    (``max_num_batched_tokens`` 8) → ``{mixed: (token ids, log-probs, seen)}``; ``watch(engine, batch)`` is called
    on every scheduled batch and what it returns (when not None) is collected in ``seen``; ``check(engine)`` runs
    before the requests; every page must be back in the pool after them."""
    res = {}
    for mixed in (False, True):
        e = engine(model, backend, max_num_batched_tokens=8, mixed_prefill=mixed)
        seen, schedule = [], e.scheduler.schedule

        def watched():
            batch = schedule()
            if batch is not None and watch is not None:
                got = watch(e, batch)
                if got is not None:
                    seen.append(got)
            return batch

        e.scheduler.schedule = watched
        try:
            if check is not None:
                check(e)
            outs = e.generate(ps, params)
            res[mixed] = ([o.token_ids for o in outs], [o.logprobs for o in outs], seen)
            assert e.cache.allocator.num_used == 0
        finally:
            e.shutdown()
    return res


def max_logprob_diff(a: list, b: list) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def check_engine_parity(hf, model, backend: str, n: int = 6, max_kl: float = 1e-4, **kw) -> dict:
    """The engine's greedy tokens equal transformers' (float32) for every prompt, and its teacher-forced
    log-probs over prompt + continuation agree (KL per row below ``max_kl``); returns the numbers."""
    from kvbench.core import SamplingParams

    vocab = hf.config.vocab_size
    e = engine(model, backend, **kw)
    try:
        ps = prompts(vocab)
        outs = e.generate(ps, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        got = [o.token_ids for o in outs]
        ref = [hf_greedy(hf, p, n) for p in ps]
        assert got == ref, f"{backend}: greedy tokens differ from transformers: {got} vs {ref}"
        full = ps[0] + got[0]
        res = e.score(ps[0][:4], full[4:], full_distribution=True)
        want = hf_logprobs(hf, full)[3:-1]
        got_lp = res.full_logprobs.float().cpu()
        kl = (want.exp() * (want - got_lp)).sum(-1)
        assert got_lp.shape == want.shape
        assert float(kl.max()) < max_kl, (backend, kl)
        diff = float((want - got_lp).abs().max())
        assert diff < 0.02, (backend, diff)
        return {"tokens": got, "max_kl": float(kl.max()), "max_logprob_diff": diff}
    finally:
        e.shutdown()


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of one prompt through our model alone (torch backend, a bf16 page cache, one prefill step)."""
    from kvbench.runtime.attention.base import AttentionMetadata, BackendOptions
    from kvbench.runtime.attention.torch_backend import TorchBackend
    from kvbench.runtime.kv_cache import PagedKVCache

    cfg, T, ps = model.config, len(ids), 16
    pages = -(-T // ps)
    cache = PagedKVCache(cfg.kv_spec("bf16", ps), pages)
    meta = AttentionMetadata("prefill", torch.arange(T), torch.arange(T), torch.arange(pages, dtype=torch.int32)[None],
                             torch.tensor([T], dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32), T, T, ps,
                             cfg.rope_cache(T), [T], [T])
    return model.logits(model(torch.tensor(ids), TorchBackend(BackendOptions()), cache, meta))


# ----------------------------------------------------------------------------------------- GGUF
def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's row order for q/k of llama-architecture models (the loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GGUF_LAYER_GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                     "post_feedforward_layernorm": "post_ffw_norm"}


def write_gguf(hf, path: Path, arch: str, name: str = "tiny", window: Optional[int] = None) -> Path:
    """``hf``'s weights and config as a float32 GGUF file of architecture ``arch`` (llama, qwen3, gemma3),
    in llama.cpp's conventions: q/k rows permuted for llama, norm weights stored as ``1 + w`` for gemma3."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rp = getattr(c, "rope_parameters", None) or {}
    rp = rp.get("full_attention", rp)
    w.add_rope_freq_base(float(rp.get("rope_theta", getattr(c, "rope_theta", 10000.0))))
    if window:
        w.add_sliding_window(window)
    layer_map = {**_GGUF_LAYER, **(_GGUF_LAYER_GEMMA if arch == "gemma3" else {"post_attention_layernorm": "ffn_norm"})}
    for k, t in hf.state_dict().items():
        t = t.detach().float()
        if k.startswith("model.layers."):
            i, rest = k[len("model.layers."):].split(".", 1)
            mod, _, kind = rest.rpartition(".")
            gname = f"blk.{i}.{layer_map[mod]}.{kind}"
            if arch == "llama" and mod in ("self_attn.q_proj", "self_attn.k_proj"):
                t = _permute(t, c.num_attention_heads if "q_proj" in mod else c.num_key_value_heads)
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[k]
            if gname == "output.weight" and c.tie_word_embeddings:
                continue
        if arch == "gemma3" and gname.endswith("norm.weight"):
            t = t + 1.0
        w.add_tensor(gname, np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def config_json(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
