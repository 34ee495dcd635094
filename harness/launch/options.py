"""How the options of a cell reach an external server's launch command, and the check that they do.

A ``server`` target's ``launch`` template is a shell command with placeholders:

    {model} {host} {port} {python} {tp_size} {devices} {extra_args}
    {kv_dtype} {kv_scales} {scales_file} {prefill_backend} {decode_backend} {attention_backend} {quantize_query}
    {kv_skip_layers}

``{attention_backend}`` is the one backend of a cell whose prefill and decode backends are the same (a cell
with two different ones cannot be rendered into it).  Values are shell-quoted; ``{kv_dtype}`` and the backend
placeholders go through the target's ``kv_dtype_map`` / ``backend_map`` first.  ``{kv_skip_layers}`` is the
KV entry's ``kv_dtype_skip_layers``: on a ``vllm`` target as vLLM's ``--kv-cache-dtype-skip-layers`` list
(one word per layer index, then ``sliding_window``), elsewhere as one word (``0,1,31``).

``option_flags`` turns a cell option into launch arguments where a bare placeholder does not fit:

    option_flags:
      kv_scales: {calibrate: --calculate-kv-scales, unit: ""}   # value-keyed: the arguments for each value
      scales_file: "--quantization-param-path {value}"          # a template: {value} is the option's value

A template entry is rendered for every value but the option's default (the default passes nothing); a
value-keyed entry renders the text given for the cell's value ("" = nothing), the default value may be left
out (it passes nothing), and any other value missing from it is refused.  Everything kvbench adds to the
template (option_flags output, then the target's ``extra_args``, the backend entry's and the KV entry's) goes
where ``{extra_args}`` stands, or at the end of the command.

**The rule** (``check_cell``): an option is *expressed* on a target when its placeholder is in the template or
it has an ``option_flags`` entry.  A cell whose value of an unexpressed option is not that option's default
is a config error naming the key that set the value and what to add — never a label the server ignores.
Defaults (what passes nothing): ``kv_dtype: auto``, backends ``default``, ``kv_scales: unit``, no
``scales_file``, ``quantize_query: false``, ``kv_scales_per_head: false``, ``fused_append: true``, no
``kv_skip_layers`` / ``kv_layer_dtypes`` (the per-layer formats; sglang has no flag for them).
No torch here.
"""

from __future__ import annotations

import re
import shlex
import string
import sys
from typing import Any, Optional

from kvbench.core import KV_SCALE_POLICIES, format_names
from kvbench.harness.config_checks import _check_keys, _choice, _fail, _int, _list, _mapping
from kvbench.harness.launch.hints import AUTO_KV, DEFAULT_BACKEND
from kvbench.harness.launch.hints import hint as _hint
from kvbench.harness.launch.hints import unexpressed as _unexpressed
from kvbench.harness.layer_options import vllm_skip_words
from kvbench.core import KV_OPTIONS

ENGINE_KINDS = ("sglang", "vllm", "kvbench", "generic")
# the cell options a server launch may carry, with the value that passes nothing: the cell's own keys, then the
# KV options (kvbench.core.kv_config: each names its launch placeholder and text)
_CELL_OPTION_DEFAULTS = {
    "kv_dtype": AUTO_KV, "kv_scales": "unit", "scales_file": None, "prefill_backend": DEFAULT_BACKEND,
    "decode_backend": DEFAULT_BACKEND, "attention_backend": DEFAULT_BACKEND,
}
_BASE_PLACEHOLDERS = ("model", "host", "port", "python", "tp_size", "devices", "extra_args")


def option_defaults() -> dict[str, Optional[str]]:
    """Every launch option with the value that passes nothing."""
    return {**_CELL_OPTION_DEFAULTS, **{o.placeholder: o.launch_value(None) for o in KV_OPTIONS.values()}}


def option_names() -> tuple[str, ...]:
    return tuple(option_defaults())


def option_placeholders() -> tuple[str, ...]:
    """The options a launch template may name as ``{placeholder}`` (the other KV options: option_flags only)."""
    return (*_CELL_OPTION_DEFAULTS, *(o.placeholder for o in KV_OPTIONS.values() if o.template))


def placeholders() -> tuple[str, ...]:
    return (*_BASE_PLACEHOLDERS, *option_placeholders())


def entry_keys() -> dict[str, str]:
    """Launch options whose values are layer sets, with the KV entry key they come from (where errors point)."""
    return {o.placeholder: o.name for o in KV_OPTIONS.values() if o.per_layer}


PORT_STAND_IN = "<port>"  # what --dry-run shows for a port picked per launch

# attention backend names of the external engines (lower-case; vLLM writes them upper-case), so the embedded
# engine can say which engine runs a name it does not have: the one table of them
_SGLANG_BACKENDS = ("triton", "torch_native", "flashinfer", "fa3", "fa4", "flashmla", "cutlass_mla", "trtllm_mla",
                    "trtllm_mha", "aiter", "wave", "flex_attention", "dual_chunk_flash_attn", "ascend", "intel_amx",
                    "nsa", "hybrid_linear_attn")
_VLLM_BACKENDS = ("flash_attn", "flashinfer", "triton_attn", "flex_attention", "flashmla", "cutlass_mla", "torch_sdpa",
                  "xformers", "rocm_attn", "rocm_aiter_fa", "tree_attn", "triton_mla", "flashattn_mla",
                  "flashinfer_mla", "pallas")
EXTERNAL_BACKENDS: dict[str, tuple[str, ...]] = {}
for _kind, _names in (("sglang", _SGLANG_BACKENDS), ("vllm", _VLLM_BACKENDS)):
    for _n in _names:
        EXTERNAL_BACKENDS.setdefault(_n, ())
        EXTERNAL_BACKENDS[_n] += (_kind,)


def external_backend_engines(name: str) -> tuple[str, ...]:
    """The external engines (``sglang``, ``vllm``) that have an attention backend of this name (any case)."""
    return EXTERNAL_BACKENDS.get(str(name).strip().lower(), ())


class LaunchError(ValueError):
    """A launch template cannot be rendered for a cell (``targets.render_launch`` turns it into a
    ``TargetError``); config validation reports the same problems as ``SweepConfigError`` first."""


# ------------------------------------------------------------------------------ values
def _bool_text(value: Any) -> str:
    return "true" if value else "false"


def option_values(cell: dict) -> dict[str, Optional[str]]:
    """The cell's value of every option, as text (None: no value, e.g. no scales file, or no single
    ``attention_backend`` when prefill and decode differ)."""
    opts = cell.get("options") or {}
    pre, dec = cell["prefill_backend"], cell["decode_backend"]
    return {
        "kv_dtype": cell["kv_dtype"], "kv_scales": cell["kv_scales"], "scales_file": cell.get("scales_file"),
        "prefill_backend": pre, "decode_backend": dec, "attention_backend": pre if pre == dec else None,
        **{o.placeholder: o.launch_value(opts.get(o.name)) for o in KV_OPTIONS.values()},
    }


def _quoted(spec, option: str, value: str) -> str:
    """An option's value as launch text: mapped, shell-quoted; a skip set on a vllm target as vLLM's list
    (one word per layer).  ``ValueError`` when the engine cannot take the value."""
    if option == "kv_skip_layers" and spec.engine_kind == "vllm":
        return " ".join(shlex.quote(w) for w in vllm_skip_words(value))
    return shlex.quote(_mapped(spec, option, value))


def _mapped(spec, option: str, value: str) -> str:
    if option == "kv_dtype":
        return spec.kv_dtype_map.get(value, value)
    if option in ("prefill_backend", "decode_backend", "attention_backend"):
        return spec.backend_map.get(value, value)
    return value


def _flag_key(option: str, key: Any) -> str:
    """A value-keyed option_flags key as the cell's value text (YAML true/false -> true/false; quantize_query's
    true/false/both/none -> both/none)."""
    opt = next((o for o in KV_OPTIONS.values() if o.placeholder == option), None)
    if opt is not None:
        return opt.launch_key(key)
    return _bool_text(key) if isinstance(key, bool) else str(key)


# ------------------------------------------------------------------------------ templates
def template_fields(text: str) -> list[str]:
    """The placeholder names of a ``str.format`` template (ValueError when its braces are malformed)."""
    return [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]


def sniff_engine_kind(launch: Optional[str], ttype: str) -> str:
    """``engine_kind`` when the config gives none: from the launch text for server targets."""
    if ttype == "embedded":
        return "kvbench"
    text = (launch or "").lower() if ttype == "server" else ""
    if "sglang" in text:
        return "sglang"
    if "vllm" in text:
        return "vllm"
    if re.search(r"kvbench(\.harness)?\s+serve\b", text):
        return "kvbench"
    return "generic"


def parse_target_options(t, d: dict, path: str) -> None:
    """The launch keys of a target mapping ``d`` onto TargetSpec ``t``: ``engine_kind``, ``option_flags``,
    ``extra_args``, ``tp_size``, ``devices``; and the launch template's placeholders."""
    server = t.type == "server"
    for key in ("option_flags", "extra_args", "tp_size", "devices"):
        if d.get(key) is not None and not server:
            _fail(f"{path}.{key}", f"applies to server targets only (this target is {t.type})")
    if server:
        try:
            fields = template_fields(t.launch)
        except ValueError as e:
            _fail(f"{path}.launch", f"not a valid template ({e}); write literal braces as {{{{ and }}}}")
        for f in fields:
            if f not in placeholders():
                _fail(f"{path}.launch", f"unknown placeholder {{{f}}}; allowed: {', '.join('{' + p + '}' for p in placeholders())}")
    kind = d.get("engine_kind")
    t.engine_kind = sniff_engine_kind(t.launch, t.type) if kind is None else _choice(kind, ENGINE_KINDS, f"{path}.engine_kind")
    if d.get("extra_args") is not None:
        t.extra_args = shell_args(d["extra_args"], f"{path}.extra_args")
    if d.get("tp_size") is not None:
        t.tp_size = _int(d["tp_size"], f"{path}.tp_size", 1)
    if d.get("devices") is not None:
        devs = [_int(x, f"{path}.devices[{i}]", 0) for i, x in enumerate(_list(d["devices"], f"{path}.devices"))]
        if len(set(devs)) != len(devs):
            _fail(f"{path}.devices", f"a device is listed twice in {devs}")
        t.devices = devs
    t.option_flags = _option_flags(d.get("option_flags"), f"{path}.option_flags")


def shell_args(value: Any, path: str) -> str:
    """Extra launch arguments: shell text that splits cleanly (balanced quotes); '' allowed."""
    if not isinstance(value, str):
        _fail(path, f"expected a string of launch arguments, got {type(value).__name__} {value!r}")
    try:
        shlex.split(value)
    except ValueError as e:
        _fail(path, f"{value!r} is not valid shell text ({e})")
    return value.strip()


def _key_choices() -> dict[str, tuple[str, ...]]:
    """The values an ``option_flags`` mapping may key (the format table is read at parse time)."""
    out = {"kv_dtype": (*format_names(), AUTO_KV), "kv_scales": KV_SCALE_POLICIES}
    out.update({o.placeholder: o.flag_choices for o in KV_OPTIONS.values() if o.flag_choices})
    return out


def _option_flags(value: Any, path: str) -> dict:
    flags = dict(_mapping(value, path))
    _check_keys(flags, option_names(), path)
    out: dict = {}
    choices = _key_choices()
    for option, spec in flags.items():
        p = f"{path}.{option}"
        if isinstance(spec, str):
            try:
                names = template_fields(spec)
            except ValueError as e:
                _fail(p, f"not a valid template ({e}); write literal braces as {{{{ and }}}}")
            if any(n != "value" for n in names):
                _fail(p, f"the only placeholder here is {{value}} (the option's value), got {spec!r}")
            out[option] = shell_args(spec, p)
        elif isinstance(spec, dict):
            if option == "scales_file" or option in entry_keys():
                _fail(p, f'{"a file path" if option == "scales_file" else "a layer list"} cannot key a mapping; use a '
                         'template such as "--flag {value}"')
            m = {}
            for key, args in spec.items():
                try:
                    k = _flag_key(option, key)
                except ValueError as e:
                    _fail(f"{p}.{key}", str(e))
                if option in choices and k not in choices[option]:
                    _fail(f"{p}.{key}", f"{key!r} is not a value of {option}; choose from: {', '.join(choices[option])}")
                if args is None:
                    args = ""
                m[k] = shell_args(args, f"{p}.{key}")
            out[option] = m
        else:
            _fail(p, f"expected a string with {{value}} or a mapping value -> arguments, got {type(spec).__name__} {spec!r}")
    return out


# ------------------------------------------------------------------------------ the check
def expressed(spec, option: str, fields: Optional[set] = None) -> bool:
    """Whether ``option`` has a placeholder in the target's template or an ``option_flags`` entry."""
    fields = set(template_fields(spec.launch)) if fields is None else fields
    return option in fields or option in spec.option_flags


def check_cell(spec, tpath: str, cell: dict, where: dict[str, str]) -> None:
    """Refuse (``SweepConfigError``) a cell of server target ``spec`` whose options the launch cannot carry.

    ``where`` maps each option to the key path that set it (``axes.kv[1].scales``); the message names that
    path, the target, and what to add."""
    fields = set(template_fields(spec.launch))
    vals = option_values(cell)
    name = f"target {spec.name!r} ({tpath})"
    pre, dec = vals["prefill_backend"], vals["decode_backend"]
    one = expressed(spec, "attention_backend", fields)
    if pre != dec and "attention_backend" in fields:
        _fail(where["prefill_backend"],
              f"prefill {pre!r} and decode {dec!r} differ, but {name} passes one backend for both phases "
              f"({{attention_backend}} in its launch template); use {{prefill_backend}} and {{decode_backend}} "
              f"instead{_hint(spec, 'prefill_backend', ' (for {kind}: {hint} ...)')}, or leave this entry out for this target")
    for option in _check_order():
        value = vals[option]
        if option in ("prefill_backend", "decode_backend"):
            ok = expressed(spec, option, fields) or (pre == dec and one)
        elif option == "kv_scales" and value == "checkpoint" and vals["scales_file"] is not None:
            ok = True  # the scales come from the file, which reached the launch (checked just before)
        else:
            ok = expressed(spec, option, fields)
        path = where.get(option, tpath)
        if not ok:
            if value != option_defaults()[option]:
                _fail(path, _unexpressed(spec, name, option, value, pre == dec, option_placeholders()))
            continue
        if value is not None and option in entry_keys():
            try:
                _quoted(spec, option, value)
            except ValueError as e:
                _fail(path, f"{name}: {e}")
        if option in fields and value is None:
            _fail(path, f"{name} passes {{{option}}} in its launch template, but this entry sets no {option}; "
                        f"give it one, or pass it through option_flags: {{{option}: '--flag {{value}}'}}, "
                        "which is rendered only when a value is set")
        _mapping_value(spec, tpath, name, option, value, path)
    if one and pre == dec:
        _mapping_value(spec, tpath, name, "attention_backend", pre, where.get("prefill_backend", tpath))


def _check_order() -> tuple[str, ...]:
    return ("kv_dtype", "prefill_backend", "decode_backend", "scales_file", "kv_scales",
            *(o.placeholder for o in KV_OPTIONS.values()))


def _mapping_value(spec, tpath: str, name: str, option: str, value: Optional[str], path: str) -> None:
    m = spec.option_flags.get(option)
    if not isinstance(m, dict) or value is None or value in m or value == option_defaults()[option]:
        return
    _fail(path, f"{option} {value!r} is not in {tpath}.option_flags.{option} of {name} (it maps "
                f"{', '.join(map(repr, m)) or 'nothing'}); add {value}: '<launch arguments>' ('' when the server "
                "needs no flag for it)")


# ------------------------------------------------------------------------------ rendering
def _devices_text(spec, devices: Optional[list[int]]) -> str:
    devs = devices if devices is not None else spec.devices
    if devs is None:
        devs = list(range(spec.tp_size))
    return ",".join(str(d) for d in devs)


def option_flag_args(spec, cell: dict) -> list[str]:
    """The launch arguments the target's ``option_flags`` give this cell, in the order of the entries."""
    vals = option_values(cell)
    out = []
    for option, flag in spec.option_flags.items():
        value = vals[option]
        if value is None:
            continue
        if isinstance(flag, dict):
            if value in flag:
                args = flag[value]
            elif value == option_defaults()[option]:
                args = ""
            else:
                raise LaunchError(f"{option} {value!r} is not in the option_flags of target {spec.name!r} "
                                  f"(it maps {', '.join(map(repr, flag))})")
        elif value == option_defaults()[option]:
            args = ""
        else:
            try:
                args = flag.format(value=_quoted(spec, option, value))
            except ValueError as e:
                raise LaunchError(f"target {spec.name!r}: {e}") from None
        if args:
            out.append(args)
    return out


def render_command(spec, cell: dict, port: Any, devices: Optional[list[int]] = None) -> str:
    """The launch command of ``cell`` on server target ``spec`` (values shell-quoted; ``port`` a number or
    ``PORT_STAND_IN``).  ``LaunchError`` when the template cannot carry the cell (see ``check_cell``)."""
    try:
        fields = set(template_fields(spec.launch))
    except ValueError as e:
        raise LaunchError(f"launch template of target {spec.name!r} is not a valid template ({e})") from None
    unknown = sorted(fields - set(placeholders()))
    if unknown:
        raise LaunchError(f"launch template of target {spec.name!r} has an unknown placeholder {unknown[0]!r}; "
                          f"allowed: {', '.join('{' + p + '}' for p in placeholders())}")
    vals = option_values(cell)
    subs = {"model": shlex.quote(str(cell["model"])), "host": shlex.quote(spec.host),
            "port": port if port == PORT_STAND_IN else shlex.quote(str(port)), "python": shlex.quote(sys.executable),
            "tp_size": str(spec.tp_size), "devices": shlex.quote(_devices_text(spec, devices))}
    for option in option_placeholders():
        if option not in fields:
            continue
        if vals[option] is None:
            why = ("its prefill and decode backends differ" if option == "attention_backend"
                   else f"the cell has no {option}")
            raise LaunchError(f"launch template of target {spec.name!r} passes {{{option}}}, but {why}")
        try:
            subs[option] = _quoted(spec, option, vals[option])
        except ValueError as e:
            raise LaunchError(f"target {spec.name!r}: {e}") from None
    extra = " ".join(a for a in (*option_flag_args(spec, cell), spec.extra_args, cell.get("extra_args") or "") if a)
    subs["extra_args"] = extra
    cmd = spec.launch.format(**subs).rstrip()
    if extra and "extra_args" not in fields:
        cmd = f"{cmd} {extra}"
    return cmd
