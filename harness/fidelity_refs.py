"""The fidelity reference of each sweep cell (``FidelityRefs``) and the lock that makes its cache safe when
cell groups run side by side (``kvbench sweep --parallel N``).

The fidelity suite looks its reference up in ``RUN/fidelity`` and computes it on a miss (opening the
reference target).  Two groups running at once with the same reference would both miss and both compute
it, launching the reference twice on the same log and pid files; ``FidelityRefs.computing`` is a
per-reference lock held around a fidelity suite until that reference has been computed once, after which
the suites of later cells read the cache side by side.  ``FidelityGuardedWork`` wraps a ``CellWork`` so its
fidelity suites take that lock.
"""

from __future__ import annotations

import json
import threading
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from kvbench.harness.cell_work import CellWork, FidelityRef
from kvbench.core import Client
from kvbench.harness.matrix import Cell, cell_config, engine_options
from kvbench.core import canonical_key
from kvbench.harness.sweep.config import SuiteSpec, SweepConfig
from kvbench.harness.targets import TargetSession


class _BorrowedClient:
    """A client handed to code that closes it, whose real owner closes it later (or runs ``on_close``)."""

    def __init__(self, client: Client, on_close: Optional[Callable[[], None]] = None):
        self._client, self._on_close = client, on_close
        self.model_id = client.model_id

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def close(self) -> None:
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()


class FidelityRefs:
    """The fidelity reference of each cell: bf16 KV and torch backends for embedded targets (the target's
    own backends otherwise), same model, target and engine options.  When the cell being run is that
    configuration its own client serves the reference; otherwise the reference target is opened only
    when the suite asks (a cache miss) and closed as soon as the suite closes its client.  A reference
    server started for a cell whose server was given devices runs on those same devices (both servers
    at once, as when the sweep runs one group at a time on shared GPUs)."""

    def __init__(self, sweep: SweepConfig, cache_dir: Path, opener: Callable):
        self.sweep, self.cache_dir, self.opener = sweep, Path(cache_dir), opener
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._computed: set[tuple[str, str]] = set()

    def reference_cell(self, cell: Cell) -> Cell:
        c = cell.config
        embedded = self.sweep.target(c["target"]).type == "embedded"
        pre, dec = ("torch", "torch") if embedded else (c["prefill_backend"], c["decode_backend"])
        cfg = cell_config(c["model"], c["target"], pre, dec, "bf16", "unit", c["concurrency"])
        return Cell(key=canonical_key(cfg), label="fidelity reference", config=cfg, index=-1, run_accuracy=True)

    def for_cell(self, cell: Cell, session: TargetSession) -> FidelityRef:
        ref = self.reference_cell(cell)
        ekw = engine_options(self.sweep, ref)
        desc = {k: v for k, v in ref.config.items() if k != "concurrency"}
        label = f"{ref.config['model']}:{ref.config['target']}:bf16:{canonical_key({**desc, 'engine': ekw})}"
        devices = (session.info or {}).get("devices")

        def make_client() -> Client:
            if ref.group == cell.group:
                return _BorrowedClient(session.client)
            target = self.sweep.target(ref.config["target"])
            if target.type == "embedded" and hasattr(session.client, "engine"):
                from kvbench.harness.engine_client import sharing_client
                from kvbench.runtime import EngineConfig

                return sharing_client(EngineConfig(**ekw), session.client)  # one copy of the weights
            stack = ExitStack()
            log_path = self.cache_dir.parent / "logs" / f"reference-{ref.key}.log"
            extra = {"devices": list(devices)} if devices is not None and target.type == "server" else {}
            ref_session = stack.enter_context(self.opener(target, ref.config, ekw, log_path, **extra))
            return _BorrowedClient(ref_session.client, on_close=stack.close)

        self.cache_dir.mkdir(parents=True, exist_ok=True)
        return FidelityRef(label, make_client, self.cache_dir, lambda: self.reference_key(ref, ekw, session).to_dict())

    def reference_key(self, ref: Cell, ekw: dict, session: TargetSession):
        """What the cache key holds about reference cell ``ref`` (harness/fidelity_key.py): an embedded
        target's model identity and logits-relevant engine settings; a server's or endpoint's reported model,
        launch command and backends, its ``/v1/models`` card read from this cell's server (same model)."""
        from kvbench.harness.fidelity_key import embedded_reference_key, server_reference_key
        from kvbench.runtime import EngineConfig

        target = self.sweep.target(ref.config["target"])
        if target.type == "embedded":
            return embedded_reference_key(EngineConfig(**ekw))
        try:  # the cell's own server serves the same model (the reference differs in KV format and backends)
            url = session.base_url()
        except Exception:
            url = None
        return server_reference_key(target, ref.config, session.model_id, url)

    @contextmanager
    def computing(self, label: str, spec: SuiteSpec) -> Iterator[None]:
        """Hold the lock of reference ``label`` (for this fidelity suite's texts and knobs) until a suite has
        computed it once; afterwards the cache serves it and nothing is held.  An ``exact`` fidelity suite
        scores its reference live every time, so it always holds the lock (one reference launch at a time)."""
        key = (label, json.dumps({"limit": spec.limit, "params": spec.params}, sort_keys=True, default=str))
        exact = bool(spec.params.get("exact"))
        with self._guard:
            if key in self._computed and not exact:
                lock = None
            else:
                lock = self._locks.setdefault(label, threading.Lock())
        if lock is None:
            yield
            return
        with lock:
            yield
            with self._guard:  # reached only when the suite returned: a failed one leaves it to the next
                self._computed.add(key)


class FidelityGuardedWork:
    """A ``CellWork`` whose fidelity suites hold ``FidelityRefs.computing`` for their reference."""

    def __init__(self, work: CellWork, refs: FidelityRefs):
        self.work, self.refs = work, refs

    def suite(self, spec: SuiteSpec, client: Client, cell: Cell, fidelity: FidelityRef):
        from kvbench.suites import needs_reference

        if not needs_reference(spec.name):
            return self.work.suite(spec, client, cell, fidelity)
        with self.refs.computing(fidelity.label, spec):
            return self.work.suite(spec, client, cell, fidelity)

    def load(self, base_url: str, model_id: str, cell: Cell):
        return self.work.load(base_url, model_id, cell)
