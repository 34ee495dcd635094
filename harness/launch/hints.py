"""What the launch check (``launch_options.check_cell``) tells a user whose cell option cannot reach a server:
per engine, the flag or ``option_flags`` entry to add (docs/external-engines.md cites the sources), and which
options an engine has no flag for at all.  No torch here."""

from __future__ import annotations

from typing import Optional

# what to add to a template, per engine
HINTS = {
    "sglang": {
        "kv_dtype": "--kv-cache-dtype {kv_dtype}",
        "prefill_backend": "--prefill-attention-backend {prefill_backend}",
        "decode_backend": "--decode-attention-backend {decode_backend}",
        "attention_backend": "--attention-backend {attention_backend}",
        "scales_file": 'option_flags: {scales_file: "--quantization-param-path {value}"}',
    },
    "vllm": {
        "kv_dtype": "--kv-cache-dtype {kv_dtype}",
        "attention_backend": "--attention-backend {attention_backend}",
        "kv_scales": 'option_flags: {kv_scales: {calibrate: "--calculate-kv-scales"}}',
        "kv_skip_layers": 'option_flags: {kv_skip_layers: "--kv-cache-dtype-skip-layers {value}"} (rendered only when '
                          'an entry sets skip layers), or --kv-cache-dtype-skip-layers {kv_skip_layers} in the launch '
                          'when every entry sets them',
    },
    "kvbench": {
        "kv_dtype": "--kv-dtype {kv_dtype}", "kv_scales": "--kv-scales {kv_scales}",
        "prefill_backend": "--prefill-backend {prefill_backend}", "decode_backend": "--decode-backend {decode_backend}",
        "quantize_query": "--quantize-query {quantize_query}",
        "kv_skip_layers": 'option_flags: {kv_skip_layers: "--kv-dtype-skip-layers {value}"}',
        "kv_layer_dtypes": 'option_flags: {kv_layer_dtypes: "--kv-layer-dtypes {value}"}',
    },
}
# (engine, option) with no flag at all: cells that set the option cannot run on that engine
NO_FLAG = {("sglang", "kv_skip_layers"), ("sglang", "kv_layer_dtypes"), ("vllm", "kv_layer_dtypes")}
_LAYER_OPTIONS = ("kv_skip_layers", "kv_layer_dtypes")


AUTO_KV = "auto"  # the KV dtype that passes nothing: the engine's own default cache dtype
DEFAULT_BACKEND = "default"  # the backend name that passes nothing: the engine's own choice

def hint(spec, option: str, fmt: str) -> str:
    """``fmt`` filled with the engine's hint for ``option`` ('' when there is none)."""
    h = HINTS.get(spec.engine_kind, {}).get(option)
    return fmt.format(kind=spec.engine_kind, hint=h) if h else ""


def _no_flag(spec, name: str, option: str, what: str) -> str:
    kind = spec.engine_kind
    if option == "kv_skip_layers":
        has = "(vLLM has --kv-cache-dtype-skip-layers, kvbench serve --kv-dtype-skip-layers)"
    else:
        has = ("(it keeps layers in the model's dtype with --kv-cache-dtype-skip-layers: use kv_dtype_skip_layers; "
               "kvbench serve has --kv-layer-dtypes)" if kind == "vllm" else "(kvbench serve has --kv-layer-dtypes)")
    return (f"{what} does not reach {name}: {kind} has no flag for it {has}, so the server would run every layer in "
            "one format while the cell says otherwise; run this entry on another target (give this target its own "
            "axes.combos or leave the entry out)")


def unexpressed(spec, name: str, option: str, value: Optional[str], same: bool, placeholders: tuple) -> str:
    """The message for a cell whose ``option`` (set to ``value``) reaches neither a placeholder nor an
    ``option_flags`` entry of target ``spec`` (``same``: its prefill and decode backends are one;
    ``placeholders``: the launch placeholders that carry a cell option)."""
    what = f"{option} {value!r}"
    if (spec.engine_kind, option) in NO_FLAG:
        return _no_flag(spec, name, option, what)
    if option in ("prefill_backend", "decode_backend"):
        place = ("{prefill_backend}/{decode_backend} (or {attention_backend} when both phases use one backend)"
                 if same else "{prefill_backend} and {decode_backend}")
        fix = f"add {place} to the launch template{hint(spec, option, ' (for {kind}: {hint})')}, or use the backend " \
              f"name {DEFAULT_BACKEND!r} (the engine's own choice, passes nothing)"
    elif option == "kv_dtype":
        fix = f"add {{kv_dtype}} to the launch template{hint(spec, option, ' (for {kind}: {hint})')}, or use the KV " \
              f"dtype {AUTO_KV!r} (the engine's default cache dtype, passes nothing)"
    elif option == "scales_file" or option in _LAYER_OPTIONS:
        fix = f"pass it with option_flags: {{{option}: '--flag {{value}}'}} (rendered only when an entry sets it)" \
              + hint(spec, option, "; for {kind}: {hint}")
    elif option in placeholders:
        fix = f"add {{{option}}} to the launch template or an option_flags entry " \
              f"({option}: '--flag {{value}}', or {{{value}: '--flag'}})" + hint(spec, option, "; for {kind}: {hint}")
    else:
        fix = f"add an option_flags entry ({option}: {{{value}: '--flag'}})"
    if option == "kv_scales":
        fix += ("; when the server gets these scales without any flag (e.g. scales it loads from the checkpoint on "
                f"its own), say so: option_flags: {{kv_scales: {{{value}: ''}}}}")
    where = "has no " + (f"{{{option}}} and its option_flags no {option!r} entry" if option in placeholders
                         else f"{option!r} entry in its option_flags")
    return (f"{what} does not reach {name}: its launch {where}, so the server would run without it while the "
            f"cell says {value!r}; {fix}")
