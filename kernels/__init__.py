"""kvbench.kernels: the Triton kernels (fused RoPE + quantize + append, paged decode and prefill over any KV
format, MLA decode and prefill), their launch configs (kernels/config.py) and the float64 references they are checked
against.  Entry point: the names below; docs/kernels.md and docs/mla.md say what each does."""

# The package's entry point: the names other packages use, each from the module that defines it, imported
# when first asked for (kvbench.core.lazy_exports), so importing the package costs nothing.
from kvbench.core.lazy import lazy_exports

_EXPORTS = {
    "fused_rope_quant_append": "append",
    "quantize_store": "append",
    "unfused_rope_quant_append": "append",
    "AttentionParams": "config",
    "DecodeOptions": "config",
    "MLADecodeOptions": "config",
    "MLAPrefillOptions": "config",
    "PagedKV": "config",
    "PrefillOptions": "config",
    "paged_decode": "decode",
    "KVFormat": "formats",
    "QuantizedKV": "formats",
    "get_format": "formats",
    "quantize_e2m1": "formats",
    "scale_from_amax": "formats",
    "unpack_nibbles": "formats",
    "rms_norm": "fused_ops",
    "silu_mul": "fused_ops",
    "LatentCache": "mla",
    "LatentLayout": "mla",
    "absorb_query": "mla",
    "rope_cos_sin_cache": "mla",
    "unabsorb_output": "mla",
    "mla_append_unfused": "mla_append",
    "WORKSPACE_BYTES": "mla_prefill",
    "quantize_absorbed_query": "mla_reference",
    "ref_append_rows": "mla_reference",
    "ref_decode": "mla_reference",
    "ref_decode_latent": "mla_reference",
    "ref_prefill": "mla_reference",
    "sequence_slots": "mla_reference",
    "WORKSPACE_CAP_BYTES": "prefill",
    "paged_prefill": "prefill",
    "build_cos_sin_cache": "reference",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
