"""Run directory and record schemas (docs/design.md §10): re-exported from the ground floor.

The run directory lives in ``kvbench.core.store``, the atomic writes and hashes in ``kvbench.core.io``,
the record field names in ``kvbench.core.records``; this module keeps the names the harness and its
tests have always imported from here.
"""

from __future__ import annotations

import os  # noqa: F401  (tests patch store.os.* to simulate a crash mid-write)

from kvbench.core.io import (  # noqa: F401
    StoreError,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_jsonl,
    atomic_write_text,
    canonical_json,
    canonical_key,
    json_default,
    prompt_hash,
    read_jsonl,
    remove_stale_temp_files,
)
from kvbench.core.records import ITEM_FIELDS, REQUEST_FIELDS, SCHEMA_VERSION  # noqa: F401
from kvbench.core.store import (  # noqa: F401
    OPTION_KEYS,
    STATUS_DONE,
    STATUS_FAILED,
    STATUS_RUNNING,
    CellRef,
    OutDirError,
    RunStore,
    check_out_dir,
    matches,
    parse_selector,
    select_cells,
)
