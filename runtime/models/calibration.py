"""KV-scale calibration: run calibration prompts with a bf16 cache and the torch backend, observing the
absolute maxima of post-RoPE K and of V per layer (and per kv-head) with ``scales.AmaxObserver``.
MLA models: the stored latent ``[c_kv | rope(k_pe)]`` is observed as both K and V (one scale per layer)."""

from __future__ import annotations

import torch

from kvbench.runtime.attention.base import AttentionMetadata, BackendOptions, apply_rope, layer_rope
from kvbench.runtime.attention.torch_backend import TorchBackend
from kvbench.runtime.config import KVCacheSpec
from kvbench.runtime.kv_cache import PagedKVCache, pages_needed
from kvbench.runtime.scales import AmaxObserver, KVScales
from kvbench.runtime.step_notes import Step

__all__ = ["CALIBRATION_TEXTS", "calibrate_scales"]

# Varied built-in texts (prose, arithmetic word problems, code, lists) so calibration needs no data files.
CALIBRATION_TEXTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Natalia sold 48/2 = 24 clips in May. "
    "Natalia sold 48+24 = 72 clips altogether in April and May. #### 72",
    "The mitochondrion is an organelle found in the cells of most eukaryotes. It generates most of the "
    "cell's supply of adenosine triphosphate, which is used as a source of chemical energy.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])",
    "Question: A train travels 120 kilometres in 1.5 hours. What is its average speed?\nAnswer: The "
    "average speed is distance divided by time, 120 / 1.5 = 80 kilometres per hour. The answer is 80.",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWrite a haiku about "
    "autumn leaves.<|im_end|>\n<|im_start|>assistant\nCrimson leaves descend,\nwhispering to the cold "
    "earth,\nsummer's last goodbye.",
    "Find all real x such that x^2 - 5x + 6 = 0. Factoring gives (x - 2)(x - 3) = 0, so x = 2 or x = 3. "
    "The sum of the roots is 5 and the product is 6, as Vieta's formulas predict.",
    "Shopping list: 2 litres of milk, a dozen eggs, 500 g of flour, three apples, olive oil, salt, "
    "pepper, 1 kg of potatoes, fresh basil, and a loaf of whole-grain bread.",
    "In 1969, Apollo 11 landed on the Moon. Neil Armstrong and Buzz Aldrin walked on the lunar surface "
    "while Michael Collins orbited above in the command module Columbia.",
)


class _ObservingBackend(TorchBackend):
    def __init__(self, opts: BackendOptions, observer: AmaxObserver):
        super().__init__(opts)
        self.observer = observer

    def forward(self, q, k, v, layer, cache, meta):
        self.observer.observe(layer.layer_idx, apply_rope(k, meta.positions, layer_rope(meta, layer)), v)
        return super().forward(q, k, v, layer, cache, meta)

    def forward_mla(self, q_nope, q_pe, c_kv, k_pe, layer, cache, meta):
        from kvbench.runtime.attention.mla_torch import rope_latent

        lat = torch.cat((c_kv, rope_latent(q_pe[:, :1], k_pe, meta)[1]), dim=-1)[:, None]
        self.observer.observe(layer.layer_idx, lat, lat)
        return super().forward_mla(q_nope, q_pe, c_kv, k_pe, layer, cache, meta)


@torch.inference_mode()
def calibrate_scales(model, tokenizer, rope, kv_dtype: str, num_prompts: int, per_head: bool, device, page_size: int = 16,
                     layer_dtypes=None) -> KVScales:
    """``layer_dtypes``: one format per layer when the cache mixes formats (each layer's scale is its format's)."""
    cfg = model.config
    texts = [CALIBRATION_TEXTS[i % len(CALIBRATION_TEXTS)] for i in range(max(num_prompts, 1))]
    prompts = [tokenizer.encode(t)[: rope.cos.shape[0]] for t in texts]
    obs = AmaxObserver(cfg.num_layers, cfg.num_kv_heads)
    note = Step(f"calibrating {kv_dtype} KV scales on {sum(len(p) for p in prompts)} tokens "
                f"({len(prompts)} prompt{'s' if len(prompts) != 1 else ''}, {cfg.num_layers} layers)")
    try:
        _observe(model, prompts, obs, cfg, rope, device, page_size)
    except BaseException:
        note.fail()
        raise
    note.done(obs.describe())
    # the observer is indexed by layer; fold the per-layer amax for fp8/nvfp4
    out = obs.scales(kv_dtype, per_head, layer_dtypes)
    out.details["calibration_prompts"] = len(prompts)
    return out


def _observe(model, prompts: list, obs: AmaxObserver, cfg, rope, device, page_size: int) -> None:
    longest = max(len(p) for p in prompts)
    spec: KVCacheSpec = cfg.kv_spec("bf16", page_size)
    npages = pages_needed(longest, page_size)
    cache = PagedKVCache(spec, npages, device=device)
    backend = _ObservingBackend(BackendOptions(kv_dtype="bf16", device=str(device)), obs)
    table = list(range(npages))
    for ids in prompts:
        T = len(ids)
        meta = AttentionMetadata(
            phase="prefill",
            positions=torch.arange(T, device=device),
            slot_mapping=torch.arange(T, device=device),
            page_table=torch.tensor([table], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([T], dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32, device=device),
            max_seqlen_q=T, max_seqlen_k=T, page_size=page_size, rope=rope,
            seq_lens_cpu=[T], q_lens_cpu=[T],
        )
        backend.plan(meta, cache)
        model(torch.tensor(ids, device=device), backend, cache, meta)
