"""What one sweep cell runs: the ``CellWork`` protocol (tests inject fakes) and ``DefaultWork``, which
calls the accuracy/fidelity suites and the load generator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

from kvbench.core import Client
from kvbench.harness.matrix import Cell
from kvbench.harness.sweep.config import SuiteSpec, SweepConfig


@dataclass
class FidelityRef:
    """How a cell's fidelity suite reaches its reference: ``label`` names the reference configuration
    (in the protocol string), ``make_client`` opens it (called only on a cache miss; the caller closes
    the client it gets), ``cache_dir`` is ``RUN/fidelity`` so the reference pass runs once per run, ``key``
    gives what the cache key holds about the reference, called only when the cache is used (None: the label)."""

    label: str
    make_client: Callable[[], Client]
    cache_dir: Path
    key: Optional[Callable[[], dict]] = None  # model identity and logits-relevant settings (harness/fidelity_key.py)


class CellWork(Protocol):
    """What a cell runs; tests inject fakes, ``DefaultWork`` calls the real suites and load generator."""

    def suite(self, spec: SuiteSpec, client: Client, cell: Cell, fidelity: FidelityRef) -> tuple[list[dict], dict]: ...

    def load(self, base_url: str, model_id: str, cell: Cell) -> tuple[dict, list[dict]]: ...


_FIDELITY_KEYS = ("exact", "top_k", "greedy_tokens")


class DefaultWork:
    def __init__(self, sweep: SweepConfig):
        self.sweep = sweep

    def suite(self, spec: SuiteSpec, client: Client, cell: Cell, fidelity: FidelityRef) -> tuple[list[dict], dict]:
        from kvbench.suites import SuiteOptions
        from kvbench.suites import FidelityContext, RunContext, needs_reference, run_suite

        params = dict(spec.params)
        ctx = RunContext()
        if needs_reference(spec.name):
            knobs = {k: params.pop(k) for k in _FIDELITY_KEYS if k in params}
            ctx.fidelity = FidelityContext(fidelity.label, fidelity.make_client, fidelity.cache_dir, key=fidelity.key, **knobs)
        opts = SuiteOptions(
            limit=spec.limit, repeats=spec.repeats, data_dir=self.sweep.data_dir, concurrency=cell.concurrency,
            seed=self.sweep.seed if spec.seed is None else spec.seed, progress=False, extra=params,
            request=self.request(spec, cell),
        )
        res = run_suite(spec.name, client, opts, ctx)
        return res.records, {**res.summary, "source": res.source}

    def request(self, spec: SuiteSpec, cell: Cell) -> dict:
        """The suite's request options on this cell's target: suite (``request`` and the top-level
        ``max_tokens`` / ``temperature``) > target ``request``; the suite's protocol defaults fill the rest
        (harness/request_options.py).  ``max_tokens`` / ``temperature`` move to ``SuiteOptions``' fields."""
        from kvbench.harness.request_options import merge_requests

        try:
            target = getattr(self.sweep.target(getattr(cell, "config", {})["target"]), "request", None)
        except KeyError:  # no target named (or an unknown one): the suite's options alone
            target = None
        top = {"max_tokens": spec.max_tokens, "temperature": spec.temperature}
        return merge_requests(target, top, getattr(spec, "request", None))

    def load(self, base_url: str, model_id: str, cell: Cell) -> tuple[dict, list[dict]]:
        from kvbench.harness.loadgen.run import LoadConfig
        from kvbench.harness.loadgen.repeats import run_repeats

        ld, slo, conc = self.sweep.load, self.sweep.slo, cell.concurrency
        cfg = LoadConfig(
            num_prompts=max(ld.num_prompts, ld.prompts_per_concurrency * conc), max_concurrency=conc,
            request_rate=ld.request_rate, burstiness=ld.burstiness, dataset=ld.dataset, input_len=ld.input_len,
            output_len=ld.output_len, range_ratio=ld.range_ratio, dataset_path=ld.dataset_path, api=ld.api,
            ignore_eos=ld.ignore_eos, warmup=ld.warmup, seed=ld.seed, salt=cell.key,
            slo_ttft_ms=slo.get("ttft_ms"), slo_tpot_ms=slo.get("tpot_ms"), slo_e2el_ms=slo.get("e2el_ms"),
            metrics_interval_s=ld.metrics_interval_s, timeout_s=ld.timeout_s, progress=False,
        )
        return run_repeats(base_url, model_id, cfg, ld.repeats, between=self._flush_between(base_url, cell))

    def _flush_between(self, base_url: str, cell: Cell) -> Optional[Callable[[int], None]]:
        """Between two load repeats: flush the server's prefix cache when its target says how (the repeats send
        the same prompts); the embedded engine keeps no prefix cache."""
        from kvbench.harness.targets import flush_cache

        try:
            spec = self.sweep.target(getattr(cell, "config", {})["target"])
        except KeyError:
            return None
        if getattr(spec, "flush_cache", None) is None:
            return None
        return lambda _i: flush_cache(base_url, spec.flush_cache, spec.api_key)
