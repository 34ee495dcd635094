"""Record schemas: the fields every per-item and per-request record carries (docs/design.md §8, §10).

Suites write item records (``suites/base.py`` ``make_record``), the load generator writes request
records; reports and the gate read them.  A record may carry more fields (error fields, suite-specific
ones); these are the ones every record has.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["SCHEMA_VERSION", "ITEM_FIELDS", "ITEM_ERROR_FIELDS", "REQUEST_FIELDS", "REPLICA_FIELD", "missing_fields",
           "check_record"]

SCHEMA_VERSION = 1

ITEM_FIELDS = (
    "suite", "item_id", "repeat", "seed", "prompt_hash", "raw_output", "extracted", "target", "correct",
    "invalid", "finish_reason", "prompt_tokens", "output_tokens", "latency_s", "scores", "protocol",
)
# what a generation suite's record adds: how a failed request failed, what the request was sent with,
# reasoning text returned apart from the answer, connection retries
ITEM_ERROR_FIELDS = ("error", "error_kind", "request_options", "reasoning", "retries")
REQUEST_FIELDS = (
    "request_id", "success", "error", "prompt_tokens", "output_tokens", "start_s", "ttft_s", "latency_s",
    "itl_s", "tpot_s",
)
# an optional field of item and request records: the base URL of the replica that served the request, on
# targets of several data-parallel replicas only (records of a one-URL target have no such field)
REPLICA_FIELD = "replica"


def missing_fields(record: dict, fields: Iterable[str] = ITEM_FIELDS) -> list[str]:
    """The names in ``fields`` that ``record`` lacks (in schema order)."""
    return [f for f in fields if f not in record]


def check_record(record: dict, fields: Iterable[str] = ITEM_FIELDS, kind: str = "item") -> dict:
    """Return ``record`` unchanged, or raise ValueError naming the missing fields (or a ``replica`` that is not
    a URL string)."""
    missing = missing_fields(record, fields)
    if missing:
        raise ValueError(f"{kind} record lacks field(s) {', '.join(missing)}")
    replica = record.get(REPLICA_FIELD)
    if REPLICA_FIELD in record and not (isinstance(replica, str) and replica.startswith(("http://", "https://"))):
        raise ValueError(f"{kind} record's {REPLICA_FIELD} must be the replica's base URL, got {replica!r}")
    return record
