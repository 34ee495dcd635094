"""Data-parallel replicas: several already-running servers of ONE configuration behind one endpoint target
(``base_url: [URL1, URL2, ...]``; docs/config.md "targets", docs/scale-out.md "Data-parallel replicas").

* ``parse_base_urls``: the config's ``base_url``, one http(s) URL or a list of distinct ones; ``urls_of_flag``
  the same for ``kvbench eval --endpoint`` / ``kvbench load --base-url`` (repeated, or comma lists).
* ``ReplicaURL``: the URL a target session hands the load test (``TargetSession.base_url()``): a ``str`` equal
  to the first replica's URL, so whatever treats it as one URL (the fidelity key, a ``/v1/models`` read) still
  works, carrying every replica (``replicas``) and the load mode (``mode``: ``aggregate`` or ``each``);
  ``replica_urls(url)`` gives the replicas of any URL (a plain one: itself).
* ``check_same_model``: every replica serves the model (and the context length) of the others, else an
  error naming the replica that differs.
* ``replica_capacity``: the per-replica KV capacities and their sum.

The concurrency of a cell applies to each replica (docs/scale-out.md): accuracy suites keep ``concurrency``
requests in flight per replica (harness/replica_client.py), the load test runs ``concurrency`` per replica
(harness/loadgen/replicas.py).  No torch here.
"""

from __future__ import annotations

from typing import Any, Optional
from urllib.parse import urlsplit

from kvbench.harness.config_checks import _fail, _str

__all__ = ["REPLICA_LOAD_MODES", "DEFAULT_REPLICA_MAX_FAILURES", "ReplicaURL", "replica_urls", "replica_mode", "parse_base_urls", "server_key",
           "urls_of_flag", "check_same_model", "replica_capacity"]

REPLICA_LOAD_MODES = ("aggregate", "each")  # one load test over all replicas at once | one replica at a time
# connection failures in a row that take a replica out of rotation (harness/replica_client.py): a target's
# ``replica_max_failures``, ``kvbench eval`` / ``kvbench sweep --replica-max-failures``
DEFAULT_REPLICA_MAX_FAILURES = 3


class ReplicaURL(str):
    """The first replica's URL, carrying every replica (``replicas``) and the load mode (``mode``)."""

    replicas: tuple
    mode: str

    def __new__(cls, urls, mode: str = "aggregate"):
        urls = tuple(str(u) for u in urls)
        if not urls:
            raise ValueError("ReplicaURL needs at least one URL")
        if mode not in REPLICA_LOAD_MODES:
            raise ValueError(f"replica load mode {mode!r}; choose one of {', '.join(REPLICA_LOAD_MODES)}")
        obj = super().__new__(cls, urls[0])
        obj.replicas, obj.mode = urls, mode
        return obj

    def __getnewargs__(self):  # pickling rebuilds it from every replica, not from the first URL's text
        return (list(self.replicas), self.mode)


def replica_urls(url: str) -> tuple:
    """The replicas behind ``url``: a ``ReplicaURL``'s every replica, a plain URL alone."""
    return tuple(getattr(url, "replicas", None) or (url,))


def replica_mode(url: str) -> str:
    return getattr(url, "mode", "aggregate")


def server_key(url: str) -> str:
    """``scheme://host:port/path`` of ``url`` as ``_key`` reads it: one text per server (the lock of a sweep's
    groups that use it)."""
    scheme, host, port, path = _key(url)
    return f"{scheme}://{host}:{port}{path}"


def _key(url: str) -> tuple:
    """What makes two URLs the same server: scheme, host (any case), port (the scheme's default filled in) and
    path (without a trailing ``/`` or ``/v1``)."""
    u = urlsplit(url)
    path = u.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return u.scheme, (u.hostname or "").lower(), u.port or (443 if u.scheme == "https" else 80), path


def parse_base_urls(value: Any, path: str) -> list[str]:
    """``base_url``: one http(s) URL or a non-empty list of distinct ones (replicas of one server
    configuration); each without its trailing ``/``.  A bad or repeated URL fails naming its key path."""
    many = isinstance(value, list)
    if many and not value:
        _fail(path, "expected an http(s) URL or a list of replica URLs, got an empty list")
    urls: list[str] = []
    for i, raw in enumerate(value if many else [value]):
        where = f"{path}[{i}]" if many else path
        url = _str(raw, where).strip().rstrip("/")
        try:
            ok = url.startswith(("http://", "https://")) and bool(urlsplit(url).hostname) and urlsplit(url).port != 0
        except ValueError:  # a port that is not a number
            ok = False
        if not ok or any(c.isspace() for c in url):
            _fail(where, f"expected an http(s) URL (http://host:port), got {raw!r}")
        same = next((u for u in urls if _key(u) == _key(url)), None)
        if same is not None:
            _fail(where, f"{url} is already listed ({same}): each replica is one server, listed once")
        urls.append(url)
    return urls


def urls_of_flag(values, flag: str) -> list[str]:
    """The URLs of a repeatable command-line flag whose values may be comma lists (``--endpoint A --endpoint
    B,C``); several are checked as a ``base_url`` list is (``parse_base_urls``: an error names ``flag[i]``),
    one is returned as given."""
    urls = [u.strip() for v in (values or []) for u in str(v).split(",") if u.strip()]
    if not urls:
        _fail(flag, "expected a URL (http://host:port)")
    return urls if len(urls) == 1 else parse_base_urls(urls, flag)


def _models(url: str, api_key: Optional[str], timeout_s: float) -> list[dict]:
    """The model cards of ``GET {url}/v1/models``; an unreachable replica or an error answer raises
    ``ConnectionError`` naming it."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ConnectionError(f"replica {url}: GET /v1/models failed ({type(e).__name__}: {e})") from None
    if r.status_code != 200:
        raise ConnectionError(f"replica {url}: GET /v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        return [c for c in (r.json().get("data") or []) if isinstance(c, dict) and c.get("id") is not None]
    except (ValueError, AttributeError):
        raise ConnectionError(f"replica {url}: GET /v1/models answered no model list: {r.text[:200]}") from None


def check_same_model(urls, model_id: Optional[str] = None, api_key: Optional[str] = None,
                     timeout_s: float = 30.0) -> str:
    """The model id every replica serves.  With ``model_id`` each replica must list it; without, each
    replica's first listed model must be the first replica's.  Where the cards state ``max_model_len`` it
    must agree too (replicas are one server configuration).  Anything else is a ``ValueError`` naming the
    replica that differs and what it serves."""
    first_url, cards = None, None
    want = model_id
    for url in urls:
        listed = _models(url, api_key, timeout_s)
        if not listed:
            raise ValueError(f"replica {url} lists no model at /v1/models")
        ids = [str(c["id"]) for c in listed]
        if want is None:
            want = ids[0]
        if model_id is not None and want not in ids:
            raise ValueError(f"replica {url} does not serve {want!r} (model_id); it lists {', '.join(ids)}: every "
                             "replica of the target must serve the same model")
        if model_id is None and ids[0] != want:
            raise ValueError(f"replica {url} serves {ids[0]!r} but replica {first_url} serves {want!r}: the "
                             "replicas of one target must serve the same model")
        card = next(c for c in listed if str(c["id"]) == want)
        if cards is None:
            first_url, cards = url, card
        elif (card.get("max_model_len") is not None and cards.get("max_model_len") is not None
              and card["max_model_len"] != cards["max_model_len"]):
            raise ValueError(f"replica {url} serves {want!r} with max_model_len {card['max_model_len']}, {first_url} "
                             f"with {cards['max_model_len']}: the replicas of one target must be one server configuration")
    return str(want)


# capacity figures that add up over replicas (each replica owns its pool and its admission limit)
_SUMMED = ("tokens", "kv_bytes", "num_pages", "max_concurrency", "max_concurrency_kv", "max_running_requests",
           "max_num_seqs")


def replica_capacity(urls, caps: list) -> Optional[dict]:
    """The capacity of a replica set: the first replica's figures (format, page size, bytes per token, context
    length ...) with the pool-sized ones summed over the replicas (``tokens``, ``kv_bytes``, ``num_pages``,
    ``max_concurrency`` ...; a figure one replica lacks is left out of the sum), and ``replicas``: each
    replica's own capacity (None where it exported none).  None when no replica names a capacity."""
    caps = list(caps)
    known = [c for c in caps if c]
    if not known:
        return None
    out = dict(known[0])
    for key in _SUMMED:
        vals = [c.get(key) for c in caps if c]
        if key in out and len(vals) == len(caps) and all(isinstance(v, (int, float)) for v in vals):
            out[key] = sum(vals)
        else:
            out.pop(key, None)
    out["replicas"] = [{"url": u, **(c or {})} if c else {"url": u, "capacity": None} for u, c in zip(urls, caps)]
    out["replica_count"] = len(caps)
    out["source"] = f"{known[0].get('source', 'server')} (summed over {len(caps)} replicas)"
    return out
