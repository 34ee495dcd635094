"""Dataset loading: a local directory first (JSONL / CSV / parquet), the dataset hub otherwise.

``--data-dir DIR`` points at files named after the dataset (``gsm8k_test.jsonl``, ``gsm8k_train.jsonl``,
``aime24.jsonl``, ``aime25.jsonl``, ``gpqa_diamond.csv`` ...).  Without a data dir, or when the file is not
there, the loader asks the dataset hub (``datasets`` installed, network reachable); failing both, the error
names the files it looked for.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet")
DATA_DIR_ENV = "KVBENCH_DATA_DIR"


class DataError(RuntimeError):
    """A dataset could not be found or has the wrong shape; the message says what was tried."""


@dataclass(frozen=True)
class HubSource:
    path: str
    name: Optional[str]
    split: str


def read_table(path: Path) -> list[dict]:
    """Rows of a JSONL, JSON (list of objects), CSV or parquet file as dicts."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{n}: not valid JSON ({e})") from None
        return rows
    if suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of objects")
        return data
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))
    if suffix == ".parquet":
        import pandas as pd

        return pd.read_parquet(path).to_dict(orient="records")
    raise DataError(f"{path}: unsupported file type (use {', '.join(EXTENSIONS)})")


def find_local(data_dir: Optional[Path], stems: tuple[str, ...]) -> Optional[Path]:
    if data_dir is None:
        return None
    for stem in stems:
        for ext in EXTENSIONS:
            p = Path(data_dir) / f"{stem}{ext}"
            if p.is_file():
                return p
    return None


def default_data_dir(data_dir: Optional[str | Path]) -> Optional[Path]:
    if data_dir:
        p = Path(data_dir)
        if not p.is_dir():
            raise DataError(f"--data-dir {p} is not a directory")
        return p
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env) if env and Path(env).is_dir() else None


def load_rows(
    data_dir: Optional[str | Path],
    stems: tuple[str, ...],
    hub: Optional[HubSource],
    required: tuple[str, ...] = (),
    hub_loader: Optional[Callable[[HubSource], list[dict]]] = None,
) -> tuple[list[dict], str]:
    """(rows, source description).  Checks that every row has the ``required`` columns."""
    local = find_local(default_data_dir(data_dir), stems)
    if local is not None:
        rows, source = read_table(local), str(local)
    elif hub is not None:
        try:
            rows = (hub_loader or _load_hub)(hub)
        except Exception as e:  # network, auth (gated sets), missing package
            names = ", ".join(f"{s}{{{','.join(EXTENSIONS)}}}" for s in stems)
            raise DataError(
                f"dataset {hub.path}/{hub.name or ''}:{hub.split} is not available ({type(e).__name__}: {e}); "
                f"pass --data-dir DIR holding one of: {names}"
            ) from None
        source = f"hub:{hub.path}/{hub.name or ''}:{hub.split}"
    else:
        raise DataError(f"no local file for {stems[0]} and no hub source; pass --data-dir")
    if not rows:
        raise DataError(f"{source}: no rows")
    missing = [c for c in required if c not in rows[0]]
    if missing:
        raise DataError(f"{source}: missing column(s) {missing}; has {sorted(rows[0])}")
    return rows, source


def _load_hub(src: HubSource) -> list[dict]:
    import datasets  # optional dependency (the `eval` extra)

    ds = datasets.load_dataset(src.path, src.name, split=src.split)
    return [dict(r) for r in ds]
