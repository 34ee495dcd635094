"""`kvbench load`: the serving load generator against any OpenAI-compatible endpoint (docs/design.md §9).

    kvbench load --max-concurrency 1,4,16 --num-prompts 64 --input-len 64 --output-len 16 --out runs/load

Several ``--base-url`` (repeated, or a comma list) are data-parallel replicas of one server configuration: each
level's concurrency applies to each replica, ``--replica-load aggregate`` (default) runs one test over all of them
at once and ``each`` one replica at a time; every request record names its ``replica`` (docs/scale-out.md).  The
load test does not fail over: a request that fails on a replica is counted failed, never sent to another one.

One run per concurrency level (``--repeats N``: N runs with the same prompts); each prints the "Serving
Benchmark Result" block (medians over the repeats), the spread across repeats and the machine's load, and, with
``--out``, writes ``OUT/c<N>/summary.json`` and ``OUT/c<N>/requests.jsonl`` (records tagged with their
``repeat``; plus ``OUT/summary.json`` with every level), atomically.
"""

from __future__ import annotations

import math
from typing import Optional

import typer


def _levels(text: Optional[str]) -> list[Optional[int]]:
    if not text or text.strip().lower() in ("inf", "none"):
        return [None]
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--max-concurrency takes integers separated by commas, got {text!r}") from None
    if not levels or min(levels) <= 0:
        raise typer.BadParameter("--max-concurrency levels must be positive")
    return levels


def _target(values: Optional[list[str]], replica_load: Optional[str], model: Optional[str], api_key: Optional[str]):
    """``(base URL, model)``: one server's URL, or a ``ReplicaURL`` of several (every replica up and serving one
    model); a ``UserError`` for a bad or unreachable URL, or ``--replica-load`` without replicas."""
    from kvbench.harness.config_checks import SweepConfigError
    from kvbench.harness.errors import UserError
    from kvbench.harness.loadgen.run import discover_model, server_root
    from kvbench.harness.replica_set import REPLICA_LOAD_MODES, ReplicaURL, check_same_model, urls_of_flag

    try:
        urls = urls_of_flag(values or ["http://127.0.0.1:8000"], "--base-url")
    except SweepConfigError as e:
        raise UserError(str(e)) from None
    if replica_load is not None and (len(urls) < 2 or replica_load not in REPLICA_LOAD_MODES):
        raise UserError(f"--replica-load {replica_load}: applies to several --base-url replicas; choose one of "
                        f"{', '.join(REPLICA_LOAD_MODES)}")
    try:
        if len(urls) > 1:
            return ReplicaURL(urls, replica_load or "aggregate"), check_same_model(urls, model, api_key)
        return urls[0], model or discover_model(urls[0], api_key)
    except Exception as e:  # noqa: BLE001 - unreachable server, bad URL, replicas that differ
        raise UserError(f"cannot reach {server_root(urls[0])}/v1/models: {e}" if len(urls) == 1 else str(e)) from None


def register(app: typer.Typer) -> None:
    @app.command("load", help="Serving load test (TTFT, TPOT, ITL, throughput) against an OpenAI-compatible endpoint.")
    def load(
        base_url: Optional[list[str]] = typer.Option(
            None, "--base-url", "--endpoint", help="Server root (or .../v1); default http://127.0.0.1:8000.  Several (repeat the flag, or a "
            "comma list): data-parallel replicas of one server configuration; --max-concurrency then applies to each replica (see "
            "--replica-load), records name their replica; no failover: a request that fails on a replica is counted failed, never sent to another"),
        replica_load: Optional[str] = typer.Option(None, "--replica-load", help="With several --base-url replicas: "
            "aggregate (default: one test over all at once, prompts, rate and concurrency × replicas, throughputs "
            "summed) or each (the test on one replica at a time)"),
        model: Optional[str] = typer.Option(None, "--model", help="Model id to request (default: the first of /v1/models)"),
        max_concurrency: Optional[str] = typer.Option(None, "--max-concurrency", help="Concurrency cap(s), comma-separated: 1,4,16 (per replica with several --base-url)"),
        num_prompts: int = typer.Option(64, "--num-prompts", help="Timed requests per level", min=1),
        request_rate: float = typer.Option(math.inf, "--request-rate", help="Requests per second (inf = all at once)"),
        burstiness: float = typer.Option(1.0, "--burstiness", help="Gamma shape of inter-arrivals (1 = Poisson)"),
        dataset: str = typer.Option("random", "--dataset", help="random, fixed, sharegpt or custom"),
        dataset_path: Optional[str] = typer.Option(None, "--dataset-path", help="ShareGPT-format JSON file, or a custom "
                                                    "JSONL of {\"prompt\", \"output_tokens\"} lines (vllm bench's format)"),
        input_len: int = typer.Option(256, "--input-len", help="Prompt tokens (random/fixed)", min=1),
        output_len: int = typer.Option(64, "--output-len", help="Output tokens", min=1),
        range_ratio: float = typer.Option(0.0, "--range-ratio", help="Lengths uniform in [L(1-r), L(1+r)]"),
        api: str = typer.Option("completions", "--api", help="completions or chat"),
        ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos", help="Force output lengths"),
        temperature: float = typer.Option(0.0, "--temperature"),
        warmup: int = typer.Option(1, "--warmup", help="Untimed requests before each level", min=0),
        seed: int = typer.Option(0, "--seed"),
        salt: str = typer.Option("", "--salt", help="Vary prompts (defeats a prefix cache between runs)"),
        slo_ttft_ms: Optional[float] = typer.Option(None, "--slo-ttft-ms", help="Goodput SLO on TTFT"),
        slo_tpot_ms: Optional[float] = typer.Option(None, "--slo-tpot-ms", help="Goodput SLO on TPOT"),
        slo_e2el_ms: Optional[float] = typer.Option(None, "--slo-e2el-ms", help="Goodput SLO on end-to-end latency"),
        metrics_interval: float = typer.Option(0.5, "--metrics-interval", help="Seconds between /metrics samples (0 = off)"),
        timeout: float = typer.Option(600.0, "--timeout", help="Per-request timeout (s)"),
        tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="tokenizer.json path, 'server' or 'none' (default: the server's)"),
        api_key: Optional[str] = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="Bearer token"),
        out: Optional[str] = typer.Option(None, "--out", help="Directory for summary.json and requests.jsonl"),
        progress: bool = typer.Option(True, "--progress/--no-progress"),
        repeats: int = typer.Option(1, "--repeats", help="Run each level N times with the same prompts; prints the "
                                    "median and the min–max spread", min=1),
    ) -> None:
        from pathlib import Path

        from kvbench.harness.loadgen.run import LoadConfig, format_block, write_outputs
        from kvbench.harness.loadgen.repeats import run_repeats, spread_lines

        levels = _levels(max_concurrency)
        try:
            configs = [
                LoadConfig(
                    num_prompts=num_prompts, max_concurrency=c, request_rate=request_rate, burstiness=burstiness,
                    dataset=dataset, input_len=input_len, output_len=output_len, range_ratio=range_ratio,
                    dataset_path=dataset_path, api=api, ignore_eos=ignore_eos, temperature=temperature, warmup=warmup,
                    seed=seed, salt=salt, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, slo_e2el_ms=slo_e2el_ms,
                    metrics_interval_s=metrics_interval, timeout_s=timeout, tokenizer=tokenizer, api_key=api_key,
                    progress=progress,
                )
                for c in levels
            ]
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        base_url, model = _target(base_url, replica_load, model, api_key)
        summaries = []
        for cfg in configs:
            try:
                summary, records = run_repeats(base_url, model, cfg, repeats)
            except (RuntimeError, ValueError) as e:
                typer.echo(f"kvbench load: error: load test failed: {e}", err=True)  # a run failure: exit 1
                raise typer.Exit(1) from None
            typer.echo(format_block(summary))
            for line in spread_lines(summary):
                typer.echo(line)
            if out:
                write_outputs(str(Path(out) / f"c{cfg.max_concurrency or 'inf'}"), summary, records)
            summaries.append(summary)
        if out:
            from kvbench.core import atomic_write_json

            atomic_write_json(Path(out) / "summary.json", {"levels": summaries})
            typer.echo(f"wrote {out}/summary.json and c<N>/requests.jsonl")
        if any(s["failed"] for s in summaries):
            raise typer.Exit(1)
