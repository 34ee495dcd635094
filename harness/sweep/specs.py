"""The sections of a sweep configuration (``sweep_config``): targets, KV axis entries, suites, the load
test and the gate, each a dataclass with its validating parser (KV and backend entries: ``sweep_axes``;
a target's launch options: ``launch_options``); and the schema's constants.  No torch here."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from kvbench.harness.config_checks import (_bool, _check_keys, _choice, _fail, _int, _list, _mapping, _num,
                                           _str)
from kvbench.harness.launch.options import sniff_engine_kind
from kvbench.harness.replica_set import DEFAULT_REPLICA_MAX_FAILURES, REPLICA_LOAD_MODES, parse_base_urls
from kvbench.harness.request_options import (DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT_S, check_suite_params,
                                             check_target_request, parse_request, suite_request)
from kvbench.suites import is_suite_name, suite_names

# KV formats, scale policies and backends: the tables of kvbench.core (format_names(), KV_SCALE_POLICIES,
# backend_names()); suites: kvbench.suites.registry (suite_names())
TARGET_TYPES = ("embedded", "server", "endpoint")
LOAD_DATASETS = ("random", "fixed", "sharegpt", "custom")
LOAD_APIS = ("completions", "chat")
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")
CELL_KEYS = ("model", "target", "prefill_backend", "decode_backend", "kv_dtype", "kv_scales", "concurrency")
# the options a KV axis entry may set besides dtype/scales: kvbench.core.kv_config (KV_OPTIONS)
DEFAULT_MODEL = "default"


@dataclass
class TargetSpec:
    """Where a cell's tokens come from.

    ``embedded``: the in-process engine (``engine`` overrides the sweep's engine options).
    ``server``: an external server started from ``launch`` (placeholders and ``option_flags``:
    harness/launch/options.py; every cell option reaches the command or the config is refused),
    health-waited, logs captured to the cell directory, its process group killed afterwards.
    ``endpoint``: an already-running OpenAI-compatible ``base_url``.
    """

    name: str
    type: str
    engine: dict = field(default_factory=dict)
    launch: Optional[str] = None
    host: str = "127.0.0.1"
    port: Optional[int] = None  # None: a free port is picked per launch
    health_path: str = "/health"
    health_timeout_s: float = 600.0
    base_url: Optional[str] = None
    model_id: Optional[str] = None  # the served model name requests use; None: ask /v1/models
    api_key: Optional[str] = None
    env: dict = field(default_factory=dict)
    flush_cache: Optional[str] = None  # e.g. "POST /flush_cache" (sglang), "POST /reset_prefix_cache" (vLLM)
    kv_dtype_map: dict = field(default_factory=dict)  # our kv_dtype name -> the server's flag value
    backend_map: dict = field(default_factory=dict)  # our backend name -> the server's flag value
    request: dict = field(default_factory=dict)  # request options of every suite on this target (harness/request_options.py)
    timeout_s: float = DEFAULT_TIMEOUT_S  # per request (server / endpoint targets)
    max_retries: int = DEFAULT_MAX_RETRIES  # retries of requests that got no response, with backoff
    # launch options (harness/launch/options.py parses them; sweep_axes.py the target's own backends)
    engine_kind: Optional[str] = None  # sglang | vllm | kvbench | generic; None in the config: sniffed from launch
    option_flags: dict = field(default_factory=dict)  # option -> "args with {value}" | {value: "args"}
    extra_args: str = ""  # appended to every launch of this target (or where {extra_args} stands)
    tp_size: int = 1  # devices one server uses ({tp_size}; --parallel gives it that many)
    devices: Optional[list] = None  # GPU ids this target may use; None: all visible
    backends: Optional[list] = None  # this target's backend entries (instead of axes.backends)
    # data-parallel replicas (harness/replica_set.py, harness/replica_targets.py): an endpoint's ``base_url``
    # given as a list of several URLs, or a server target's ``replicas: N`` (N copies launched)
    replicas: Optional[list] = None  # every replica's URL (base_url: the first); None: one server
    replica_load: str = "aggregate"  # the load test: over all replicas at once (aggregate) or one at a time (each)
    server_replicas: int = 1  # the config's ``replicas`` of a server target: copies launched per cell group
    # connection failures in a row that take a replica out of rotation (harness/replica_client.py)
    replica_max_failures: int = DEFAULT_REPLICA_MAX_FAILURES


# the config key ``replicas`` is a server target's copy count (``server_replicas``); an endpoint's replicas
# are its ``base_url`` list
_TARGET_KEYS = (*(k for k in TargetSpec.__dataclass_fields__ if k not in ("replicas", "server_replicas")), "replicas")


def _target(d: Any, path: str, engine_keys: tuple[str, ...]) -> TargetSpec:
    d = _mapping(d, path)
    _check_keys(d, _TARGET_KEYS, path)
    name = _str(d.get("name"), f"{path}.name")
    ttype = _choice(d.get("type"), TARGET_TYPES, f"{path}.type")
    t = TargetSpec(name=name, type=ttype)
    t.engine = _mapping(d.get("engine"), f"{path}.engine")
    _check_keys(t.engine, engine_keys, f"{path}.engine")
    if t.engine and ttype != "embedded":
        _fail(f"{path}.engine", "engine options apply to embedded targets only")
    if ttype == "server":
        t.launch = _str(d.get("launch"), f"{path}.launch")
        if "{port}" not in t.launch:
            _fail(f"{path}.launch", "the launch template must contain {port}")
    elif "launch" in d:
        _fail(f"{path}.launch", f"launch applies to server targets only (this target is {ttype})")
    if ttype == "endpoint":
        urls = parse_base_urls(d.get("base_url"), f"{path}.base_url")  # one URL, or a list of replicas
        t.base_url, t.replicas = urls[0], (urls if len(urls) > 1 else None)
    elif "base_url" in d:
        _fail(f"{path}.base_url", f"base_url applies to endpoint targets only (this target is {ttype})")
    if d.get("replicas") is not None:
        if ttype != "server":
            _fail(f"{path}.replicas", "applies to server targets (copies kvbench launches); an endpoint target "
                                      "lists its replicas under base_url" if ttype == "endpoint" else
                  "applies to server targets only (copies kvbench launches)")
        t.server_replicas = _int(d["replicas"], f"{path}.replicas", 1)
    if "replica_load" in d:
        if not t.replicas and t.server_replicas < 2:
            _fail(f"{path}.replica_load", "applies to an endpoint target whose base_url lists several replicas, "
                                          "or a server target of replicas: 2 or more")
        t.replica_load = _choice(d["replica_load"], REPLICA_LOAD_MODES, f"{path}.replica_load")
    if d.get("replica_max_failures") is not None:
        if not t.replicas and t.server_replicas < 2:
            _fail(f"{path}.replica_max_failures", "applies to an endpoint target whose base_url lists several "
                                                  "replicas, or a server target of replicas: 2 or more")
        t.replica_max_failures = _int(d["replica_max_failures"], f"{path}.replica_max_failures", 1)
    if "host" in d:
        t.host = _str(d["host"], f"{path}.host")
    if d.get("port") is not None:
        t.port = _int(d["port"], f"{path}.port", 1)
    if "health_path" in d:
        t.health_path = _str(d["health_path"], f"{path}.health_path")
    if "health_timeout_s" in d:
        t.health_timeout_s = _num(d["health_timeout_s"], f"{path}.health_timeout_s", 0.1)
    for k in ("model_id", "api_key", "flush_cache"):
        if d.get(k) is not None:
            setattr(t, k, _str(d[k], f"{path}.{k}"))
    if t.flush_cache is not None:
        parts = t.flush_cache.split()
        if len(parts) != 2 or parts[0] not in ("GET", "POST") or not parts[1].startswith("/"):
            _fail(f"{path}.flush_cache", f"expected 'POST /path' or 'GET /path', got {t.flush_cache!r}")
    t.request = parse_request(d.get("request"), f"{path}.request")
    check_target_request(ttype, t.request, f"{path}.request")
    for k in ("timeout_s", "max_retries"):
        if d.get(k) is not None and ttype == "embedded":
            _fail(f"{path}.{k}", "applies to server and endpoint targets only (this target is embedded)")
    if d.get("timeout_s") is not None:
        t.timeout_s = _num(d["timeout_s"], f"{path}.timeout_s", 1e-3)
    if d.get("max_retries") is not None:
        t.max_retries = _int(d["max_retries"], f"{path}.max_retries", 0)
    for k in ("env", "kv_dtype_map", "backend_map"):
        m = _mapping(d.get(k), f"{path}.{k}")
        setattr(t, k, {str(a): str(b) for a, b in m.items()})
    return t


# target keys added after runs were recorded: left out of to_dict while they hold these defaults
_ADDED_TARGET_DEFAULTS = {"option_flags": {}, "extra_args": "", "tp_size": 1, "devices": None, "backends": None,
                          "request": {}, "timeout_s": DEFAULT_TIMEOUT_S, "max_retries": DEFAULT_MAX_RETRIES,
                          "replicas": None, "replica_load": "aggregate", "server_replicas": 1,
                          "replica_max_failures": DEFAULT_REPLICA_MAX_FAILURES}


def _target_dict(t: TargetSpec) -> dict:
    """A target as the config spells it (the manifest's copy; ``parse_config`` reads it back)."""
    d = asdict(t)
    for k, v in _ADDED_TARGET_DEFAULTS.items():
        if k in d and d[k] == v:
            d.pop(k)
    if d.get("engine_kind") in (None, sniff_engine_kind(t.launch, t.type)):
        d.pop("engine_kind", None)
    if t.backends is not None:
        d["backends"] = [b.to_json() for b in t.backends]
    if d.pop("replicas", None):  # an endpoint's replicas: its base_url list
        d["base_url"] = list(t.replicas)
    if d.pop("server_replicas", 1) != 1:  # a server target's copies: the config's replicas
        d["replicas"] = t.server_replicas
    return d


@dataclass
class KVSpec:
    """A KV axis entry (parsed by ``sweep_axes.parse_kv_entry``)."""

    dtype: str
    scales: str = "unit"
    options: dict = field(default_factory=dict)  # the KV options this entry sets (canonical values)
    scales_file: Optional[str] = None  # a quantization-param file / checkpoint path ({scales_file})
    extra_args: str = ""  # launch arguments this entry adds (server targets)


@dataclass
class SuiteSpec:
    name: str
    limit: Optional[int] = None
    repeats: int = 1
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    seed: Optional[int] = None
    params: dict = field(default_factory=dict)  # passed through to the suite
    request: dict = field(default_factory=dict)  # request options (harness/request_options.py); beat the target's


_SUITE_KEYS = tuple(SuiteSpec.__dataclass_fields__)


def _suite(d: Any, path: str) -> SuiteSpec:
    if isinstance(d, str):
        d = {"name": d}
    d = _mapping(d, path)
    _check_keys(d, _SUITE_KEYS, path)
    name = _str(d.get("name"), f"{path}.name")
    if not is_suite_name(name):
        _fail(f"{path}.name", f"{name!r} is not a known suite; choose one of: {', '.join(suite_names())}")
    s = SuiteSpec(name=name)
    if d.get("limit") is not None:
        s.limit = _int(d["limit"], f"{path}.limit", 1)
    if "repeats" in d:
        s.repeats = _int(d["repeats"], f"{path}.repeats", 1)
    if d.get("max_tokens") is not None:
        s.max_tokens = _int(d["max_tokens"], f"{path}.max_tokens", 1)
    if d.get("temperature") is not None:
        s.temperature = _num(d["temperature"], f"{path}.temperature")
    if d.get("seed") is not None:
        s.seed = _int(d["seed"], f"{path}.seed")
    s.params = dict(_mapping(d.get("params"), f"{path}.params"))
    s.request = suite_request(s, path, d)
    check_suite_params(name, s.params, f"{path}.params")
    _suite_params(name, s.params, f"{path}.params")
    return s


def _suite_params(name: str, params: dict, path: str) -> None:
    """A suite's own params (the suite's checker in suites/registry.py, e.g. ruler's context_lengths, depths,
    tasks, haystack ...), checked when the config loads; the error points at the key it names."""
    from kvbench.suites import SuiteError
    from kvbench.suites import check_params

    try:
        check_params(name, params)
    except SuiteError as e:
        msg = str(e)
        key = msg[len(name) + 1:].split(":", 1)[0] if msg.startswith(name + " ") else ""
        _fail(f"{path}.{key}" if key in params else path, msg.split(": ", 1)[-1])


@dataclass
class LoadSpec:
    """The load test of every cell (concurrency comes from the cell).  ``num_prompts`` per cell is
    ``max(num_prompts, prompts_per_concurrency * concurrency)``; ``seed`` is varied per cell so cells never
    reuse each other's prompts (no cross-cell prefix-cache hits).  ``repeats``: how many times each cell's load
    test runs (same prompts; the report shows the spread across repeats; 1 = no spread measured)."""

    enabled: bool = True
    num_prompts: int = 16
    prompts_per_concurrency: int = 0
    dataset: str = "random"
    dataset_path: Optional[str] = None
    input_len: int = 128
    output_len: int = 32
    range_ratio: float = 0.0
    request_rate: float = math.inf
    burstiness: float = 1.0
    warmup: int = 1
    api: str = "completions"
    ignore_eos: bool = True
    seed: int = 0
    timeout_s: float = 600.0  # per request
    metrics_interval_s: float = 0.5  # server /metrics sampling period; 0 = off
    repeats: int = 1  # load tests per cell (harness/loadgen/repeats.py)


_LOAD_KEYS = tuple(LoadSpec.__dataclass_fields__)


def _load(d: Any, path: str) -> LoadSpec:
    d = _mapping(d, path)
    _check_keys(d, _LOAD_KEYS, path)
    s = LoadSpec()
    for k in ("enabled", "ignore_eos"):
        if k in d:
            setattr(s, k, _bool(d[k], f"{path}.{k}"))
    for k, lo in (("num_prompts", 1), ("prompts_per_concurrency", 0), ("input_len", 1), ("output_len", 1), ("warmup", 0), ("seed", 0),
                  ("repeats", 1)):
        if k in d:
            setattr(s, k, _int(d[k], f"{path}.{k}", lo))
    if "range_ratio" in d:
        s.range_ratio = _num(d["range_ratio"], f"{path}.range_ratio")
        if s.range_ratio >= 1:
            _fail(f"{path}.range_ratio", f"expected a number in [0, 1), got {s.range_ratio}")
    if "timeout_s" in d:
        s.timeout_s = _num(d["timeout_s"], f"{path}.timeout_s", 1e-3)
    if "metrics_interval_s" in d:
        s.metrics_interval_s = _num(d["metrics_interval_s"], f"{path}.metrics_interval_s")
    if "request_rate" in d:
        s.request_rate = _num(d["request_rate"], f"{path}.request_rate", 0.0, allow_inf=True)
        if s.request_rate == 0:
            _fail(f"{path}.request_rate", "must be > 0 (or inf for all at once)")
    if "burstiness" in d:
        s.burstiness = _num(d["burstiness"], f"{path}.burstiness", 1e-9)
    if "dataset" in d:
        s.dataset = _choice(d["dataset"], LOAD_DATASETS, f"{path}.dataset")
    if "api" in d:
        s.api = _choice(d["api"], LOAD_APIS, f"{path}.api")
    if d.get("dataset_path") is not None:
        s.dataset_path = _str(d["dataset_path"], f"{path}.dataset_path")
    if s.dataset in ("sharegpt", "custom") and not s.dataset_path:
        _fail(f"{path}.dataset_path", f"the {s.dataset} dataset needs dataset_path")
    return s


@dataclass
class GateSpec:
    """Non-inferiority thresholds (reports/gate/check.py reads them from the manifest's config).  ``max_drop``
    is one number for every gated suite or a mapping suite (or "suite:metric", e.g. ``ruler:auc``) -> largest
    allowed accuracy drop (absolute); ``metrics`` picks what is gated ("suite" or "suite:metric"; default every
    accuracy suite).  Long-context suites (ruler) also take the metrics ``auc`` (area under the
    accuracy-vs-length curve) and ``L<length>`` (the items of one requested context length)."""

    max_drop: Any = field(default_factory=dict)
    confidence: float = 0.95
    max_invalid_rate_increase: Optional[float] = None
    max_truncation_rate_increase: Optional[float] = None
    # fidelity limits against the reference: a number sets one, false turns it off, None keeps the default
    # (reports/gate/types.py; docs/verdict.md "Default limits")
    max_kl_mean: Any = None  # mean per-token KL
    metrics: Optional[list] = None
    max_error_rate: Optional[float] = None  # failed requests per cell and gated suite (default 0.01)
    max_ppl_ratio: Any = None  # candidate / reference perplexity
    min_top1_agreement: Any = None  # share of positions whose top-1 token matches the reference's


_GATE_KEYS = tuple(GateSpec.__dataclass_fields__)


def _gate(d: Any, path: str, suites: list[SuiteSpec]) -> GateSpec:
    d = _mapping(d, path)
    _check_keys(d, _GATE_KEYS, path)
    g = GateSpec()
    names = [s.name for s in suites]
    md = d.get("max_drop")
    if isinstance(md, (int, float)) and not isinstance(md, bool):
        g.max_drop = _num(md, f"{path}.max_drop")
    else:
        for suite, drop in _mapping(md, f"{path}.max_drop").items():
            if suite not in names and not any(str(suite).startswith(f"{n}:") for n in names):
                _fail(f"{path}.max_drop.{suite}", f"not a suite of this sweep; suites: {', '.join(names) or '(none)'}")
            _gate_metric(str(suite), f"{path}.max_drop.{suite}")
            g.max_drop[suite] = _num(drop, f"{path}.max_drop.{suite}")
    if "confidence" in d:
        g.confidence = _num(d["confidence"], f"{path}.confidence")
        if not 0.5 <= g.confidence < 1:
            _fail(f"{path}.confidence", f"expected a number in [0.5, 1), got {g.confidence}")
    for k in ("max_invalid_rate_increase", "max_truncation_rate_increase", "max_error_rate"):
        if d.get(k) is not None:
            setattr(g, k, _num(d[k], f"{path}.{k}"))
    for k in ("max_kl_mean", "max_ppl_ratio", "min_top1_agreement"):
        if d.get(k) is False or d.get(k) == "off":
            setattr(g, k, False)
        elif d.get(k) is not None:
            setattr(g, k, _num(d[k], f"{path}.{k}"))
    if d.get("metrics") is not None:
        g.metrics = [_str(m, f"{path}.metrics[{i}]") for i, m in enumerate(_list(d["metrics"], f"{path}.metrics"))]
        for i, m in enumerate(g.metrics):
            if m.split(":")[0] not in names and not m.startswith("lm_eval:"):
                _fail(f"{path}.metrics[{i}]", f"{m!r} names no suite of this sweep; suites: {', '.join(names) or '(none)'}")
            _gate_metric(m, f"{path}.metrics[{i}]")
    return g


def _gate_metric(spec: str, path: str) -> None:
    """A length metric of a ``suite:L<length>`` gate name must be a positive token length."""
    if spec.startswith("lm_eval:"):
        return
    _, _, metric = spec.partition(":")
    if metric[:1] not in ("L", "l") or not metric[1:2].isdigit():
        return  # not a length metric (auc, a score name, or the suite alone)
    if not metric[1:].isdigit():
        _fail(path, f"{spec!r}: a length metric is L<tokens>, e.g. ruler:L4096")
    if int(metric[1:]) <= 0:
        _fail(path, f"{spec!r}: the context length must be positive")

