"""`kvbench sweep CONFIG [--out RUN] [--resume] [--only SELECTOR] [--executor ray [--address ADDR]]`: run a sweep
matrix into a run directory (the cell groups in this process, or as Ray tasks: ``harness/ray_executor.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvbench.harness.errors import UserError

DATA_DIR_ENV = "KVBENCH_DATA_DIR"  # suites.data.DATA_DIR_ENV (not imported: --help stays light)


def _check_run_dir(run_dir: Path) -> None:
    """A run directory must be a directory or creatable (``store.check_out_dir``), as a config error."""
    from kvbench.core import OutDirError, check_out_dir
    from kvbench.harness.sweep.config import SweepConfigError

    try:
        check_out_dir(run_dir, "--out")
    except OutDirError as e:
        raise SweepConfigError(str(e)) from None


def _device_plans(cfg, cells, parallel: int, devices: Optional[str]):
    """``--devices`` parsed and the cell groups' device plans (``harness/parallel.py``); a
    ``SweepConfigError`` for a bad ``--parallel`` / ``--devices`` or a server that can never get its devices."""
    from kvbench.harness.matrix import groups
    from kvbench.harness.parallel import parse_devices, plan_groups

    device_ids = parse_devices(devices) if devices is not None else None
    return device_ids, plan_groups(cfg, groups(cells), parallel, device_ids)


def _echo_device_plan(plans, parallel: int) -> None:
    """Which devices each cell group would get if every group took equally long (``--dry-run``)."""
    from kvbench.harness.parallel import simulate

    typer.echo(f"device plan (--parallel {parallel}; groups taking equally long):")
    for p, (wave, devs) in zip(plans, simulate(plans, parallel)):
        where = f"devices {','.join(map(str, devs))}" if devs is not None else "no devices assigned"
        reps = f", {p.replicas} replicas" if p.replicas > 1 else ""
        typer.echo(f"  wave {wave + 1}: {p.cells[0].label} ({p.kind} {p.target}, tp_size {p.tp_size}{reps}, "
                   f"{len(p.cells)} cells): {where}")


def _launch_listing(cfg, plans, parallel: int) -> list[str]:
    """The exact launch command of every server cell group (``--dry-run``; rendered before a real sweep too,
    so a template that cannot carry a cell stops it).  The port is the target's ``port`` or ``<port>`` (a
    free one is picked per launch); devices are those the device plan gives the group, if any."""
    from kvbench.harness.launch.options import PORT_STAND_IN
    from kvbench.harness.parallel import simulate
    from kvbench.harness.sweep.config import SweepConfigError
    from kvbench.harness.targets import TargetError, render_launch

    from kvbench.harness.parallel import replica_devices

    lines: list[str] = []
    for p, (_, devs) in zip(plans, simulate(plans, parallel)):
        spec = cfg.target(p.target)
        if spec.type != "server":
            continue
        first = p.cells[0]
        lines.append(f"launch for {first.label} ({len(p.cells)} cell{'s' if len(p.cells) != 1 else ''}, "
                     f"target {spec.name}{f', {p.replicas} replicas' if p.replicas > 1 else ''}):")
        for i, mine in enumerate(replica_devices(devs, p.replicas, p.tp_size)):  # one launch per replica
            try:
                cmd = render_launch(spec, first.config, spec.port + i if spec.port else PORT_STAND_IN, devices=mine)
            except TargetError as e:
                raise SweepConfigError(f"target {spec.name!r}, cells {first.label}: {e}") from None
            env = dict(spec.env)
            if mine is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, mine))
            if env:
                lines.append("  env " + " ".join(f"{k}={v}" for k, v in env.items()))
            lines.append(f"  $ {cmd}")
    return lines


# the command's arguments and options (module level, so ``sweep``'s signature stays short)
ConfigArg = Annotated[str, typer.Argument(help="Sweep config YAML (e.g. configs/default.yaml)")]
OutOpt = Annotated[Optional[str], typer.Option("--out", help="Run directory (default: runs/<config name>)")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Finish an interrupted run: skip done cells, redo the rest")]
OnlyOpt = Annotated[Optional[str], typer.Option("--only", help="Run only cells matching key=value[,key=value]")]
DataDirOpt = Annotated[Optional[str], typer.Option("--data-dir", help="Local dataset directory (overrides the config's data_dir)")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="List the cells and exit")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar (off: one plain line per cell)")]
ParallelOpt = Annotated[int, typer.Option("--parallel", help="Run up to N server cell groups at once, each server on its "
                                          "own devices and port (load generators share this host's CPU)")]
DevicesOpt = Annotated[Optional[str], typer.Option("--devices", help="GPU ids the servers may use, e.g. 0,1,2,3 "
                                                   "(default: each target's devices, else the visible GPUs); a server "
                                                   "target of replicas: N takes N × tp_size of them, tp_size per "
                                                   "replica")]
ExecutorOpt = Annotated[str, typer.Option("--executor", help="Where cell groups run: local (this process) or ray "
                                          "(one Ray task per group, results sent back to this run directory; "
                                          'needs pip install "kvbench\\[ray]")', show_default=True)]
AddressOpt = Annotated[Optional[str], typer.Option(
    "--address", help="Ray cluster address for --executor ray, e.g. 10.0.0.5:6379 or ray://head:10001 "
    "(default: $RAY_ADDRESS, a Ray started on this machine, else a new local one)")]
RayRetriesOpt = Annotated[Optional[int], typer.Option(
    "--ray-retries", help="--executor ray: new attempts of a cell group whose worker or node died, for its "
    "unfinished cells (default 1; then they are recorded failed)")]
RayCpusOpt = Annotated[Optional[float], typer.Option(
    "--ray-cpus-per-group", help="--executor ray: CPUs each cell group's task reserves (default 1; GPUs follow "
    "the target: a server's tp_size × its replicas, 1 for an embedded engine on CUDA)")]
RayResourcesOpt = Annotated[Optional[str], typer.Option(
    "--ray-resources", help="--executor ray: custom Ray resources every cell group's task asks for, as JSON, e.g. "
    "'{\"h100\": 1}' to run the groups only on the nodes started with ray start --resources='{\"h100\": 8}'; a "
    "retry after a node died asks for them too")]
ReplicaFailuresOpt = Annotated[Optional[int], typer.Option(
    "--replica-max-failures", help="Targets of several data-parallel replicas (an endpoint's base_url list, a "
    "server's replicas: N): connection failures in a row that take a replica out of rotation for the rest of its "
    "cell group, overriding every such target's replica_max_failures (default 3)")]


def register(app: typer.Typer) -> None:
    @app.command("sweep")
    def sweep(
        config: ConfigArg, out: OutOpt = None, resume: ResumeOpt = False, only: OnlyOpt = None,
        data_dir: DataDirOpt = None, dry_run: DryRunOpt = False, progress: ProgressOpt = True,
        parallel: ParallelOpt = 1, devices: DevicesOpt = None, executor: ExecutorOpt = "local",
        address: AddressOpt = None, ray_retries: RayRetriesOpt = None, ray_cpus_per_group: RayCpusOpt = None,
        ray_resources: RayResourcesOpt = None, replica_max_failures: ReplicaFailuresOpt = None,
    ) -> None:
        """Run the matrix of a sweep config: accuracy suites, fidelity, load tests and capacity per cell.

        Data-parallel replicas are set in the config (docs/scale-out.md): an endpoint target's base_url may list
        several URLs, a server target's replicas: N launches N copies; a cell's concurrency then applies to each
        replica, a request a replica fails to answer goes to another, a replica that keeps failing
        (--replica-max-failures) leaves the rotation, and replica_load: aggregate | each says how the load test
        runs (the load test never moves a failed request: it counts as failed)."""
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        ray = _ray_options(executor, address, ray_retries, ray_cpus_per_group, parallel, devices, dry_run,
                           ray_resources)
        cfg, cells, run_dir, device_ids, plans, launches = _plan(config, out, only, data_dir, parallel, devices,
                                                                 replica_max_failures)
        if dry_run:
            _dry_run(cfg, cells, run_dir, device_ids, plans, launches, parallel, ray)
            return
        _run(cfg, config, run_dir, resume=resume, only=only, data_dir=data_dir, progress=progress,
             parallel=parallel, devices=devices, device_ids=device_ids, ray=ray,
             replica_max_failures=replica_max_failures)


def _ray_options(executor: str, address: Optional[str], retries: Optional[int], cpus: Optional[float], parallel: int,
                 devices: Optional[str], dry_run: bool, resources: Optional[str] = None):
    """``RayOptions`` for ``--executor ray`` (Ray imported, unless ``--dry-run``), None for ``local``; a
    ``UserError`` for an unknown executor, Ray flags without ``--executor ray``, or ``--parallel`` /
    ``--devices`` with it (Ray places the groups and gives them their GPUs)."""
    from kvbench.harness.ray_executor import EXECUTORS, RayOptions, import_ray
    from kvbench.harness.sweep.config import SweepConfigError

    if executor not in EXECUTORS:
        raise UserError(f"--executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    flags = {"--address": address, "--ray-retries": retries, "--ray-cpus-per-group": cpus,
             "--ray-resources": resources}
    if executor != "ray":
        given = [f for f, v in flags.items() if v is not None]
        if given:
            raise UserError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --executor ray only")
        return None
    if parallel != 1 or devices is not None:
        raise UserError("--parallel and --devices are for the local executor: with --executor ray each cell group is "
                        "a Ray task and Ray decides where and how many run at once, and which GPUs they get")
    try:
        opts = RayOptions(address=address, retries=1 if retries is None else retries,
                          cpus_per_group=1.0 if cpus is None else cpus, resources=resources)
        if not dry_run:
            import_ray()
    except SweepConfigError as e:
        raise UserError(str(e)) from None
    return opts


def replica_max_failures_override(cfg, value: Optional[int]) -> None:
    """``--replica-max-failures N``: every target of several replicas takes N as its ``replica_max_failures``; a
    ``SweepConfigError`` for N < 1 or a config without such a target."""
    from kvbench.harness.sweep.config import SweepConfigError

    if value is None:
        return
    if value < 1:
        raise SweepConfigError(f"--replica-max-failures must be a whole number >= 1, got {value}")
    several = [t for t in cfg.targets if t.replicas or t.server_replicas > 1]
    if not several:
        raise SweepConfigError("--replica-max-failures applies to targets of several replicas (an endpoint whose "
                               "base_url lists several URLs, a server target of replicas: 2 or more); this config "
                               "has none")
    for t in several:
        t.replica_max_failures = value


def _plan(config: str, out: Optional[str], only: Optional[str], data_dir: Optional[str], parallel: int,
          devices: Optional[str], replica_max_failures: Optional[int] = None):
    """The config loaded (``--data-dir`` or the environment's data directory recorded, ``--replica-max-failures``
    applied), its cells, the run directory, the device plans and the launch listing; a config error as a
    ``UserError``."""
    from kvbench.harness.matrix import expand, select
    from kvbench.harness.sweep.config import SweepConfigError, load_config

    try:
        cfg = load_config(config)
        replica_max_failures_override(cfg, replica_max_failures)
        if data_dir is not None:
            if not Path(data_dir).is_dir():
                raise SweepConfigError(f"--data-dir {data_dir} is not a directory")
            cfg.data_dir = data_dir
        elif cfg.data_dir is None and os.environ.get(DATA_DIR_ENV) and Path(os.environ[DATA_DIR_ENV]).is_dir():
            # the suites would read it from the environment: record it (the manifest, --resume checks)
            cfg.data_dir = os.environ[DATA_DIR_ENV]
        cells = select(expand(cfg), only)
        run_dir = Path(out or Path("runs") / cfg.name)
        _check_run_dir(run_dir)
        device_ids, plans = _device_plans(cfg, cells, parallel, devices)
        launches = _launch_listing(cfg, plans, parallel)
    except SweepConfigError as e:
        raise UserError(str(e)) from None
    return cfg, cells, run_dir, device_ids, plans, launches


def _dry_run(cfg, cells, run_dir: Path, device_ids, plans, launches: list[str], parallel: int, ray=None) -> None:
    """``--dry-run``: the device plan (when devices are in play) or the Ray tasks, every cell and launch command,
    the count."""
    if ray is not None:
        _echo_ray_plan(cfg, plans, ray)
    elif parallel > 1 or device_ids is not None or any(p.allowed is not None for p in plans):
        _echo_device_plan(plans, parallel)
    from kvbench.harness.sweep.dry_run import cell_line, check_models

    check_models(cfg, cells)
    for c in cells:
        typer.echo(cell_line(cfg, c))
    for line in launches:
        typer.echo(line)
    typer.echo(f"{len(cells)} cells -> {run_dir}")


def _echo_ray_plan(cfg, plans, ray) -> None:
    """``--dry-run --executor ray``: the Ray task of each cell group and what it reserves."""
    from kvbench.harness.ray_resources import describe_resources

    where = ray.address or "$RAY_ADDRESS, a Ray started on this machine, else a new local one"
    typer.echo(f"executor ray ({where}; --ray-retries {ray.retries}): one task per cell group")
    for p in plans:
        n = len(p.cells)
        typer.echo(f"  {p.cells[0].label} ({n} cell{'s' if n != 1 else ''}, {p.kind} target {p.target}): "
                   f"{describe_resources(cfg, p, ray.cpus_per_group, ray.resources)}")


def _ray_words(ray) -> list[str]:
    """The ``--executor ray`` flags of the resume command (those that were given, and the executor)."""
    if ray is None:
        return []
    words = ["--executor", "ray"]
    if ray.address is not None:
        words += ["--address", ray.address]
    if ray.retries != 1:
        words += ["--ray-retries", str(ray.retries)]
    if ray.cpus_per_group != 1:
        words += ["--ray-cpus-per-group", f"{ray.cpus_per_group:g}"]
    if ray.resources:
        words += ["--ray-resources", json.dumps(ray.resources, separators=(",", ":"))]
    return words


def _run(cfg, config: str, run_dir: Path, *, resume: bool, only: Optional[str], data_dir: Optional[str],
         progress: bool, parallel: int, devices: Optional[str], device_ids, ray=None,
         replica_max_failures: Optional[int] = None) -> None:
    """Run the sweep and say how it went: the counts, how to redo failed cells (exit 1) or finish an
    interrupted run (exit 130 / 143), else the report and gate commands."""
    from kvbench.harness.runner import run_sweep
    from kvbench.harness.sweep.config import SweepConfigError
    from kvbench.harness.sweep.hints import (
        SweepTerminated,
        finished_commands,
        interrupted_lines,
        resume_command,
        sigterm_as_interrupt,
    )

    import shlex

    words = _ray_words(ray)
    if replica_max_failures is not None:
        words += ["--replica-max-failures", str(replica_max_failures)]
    again = " ".join([resume_command(config, run_dir, only=only, data_dir=data_dir, parallel=parallel,
                                     devices=devices), *map(shlex.quote, words)])
    extra = {}
    if ray is not None:
        from kvbench.harness.ray_executor import RayExecutor

        extra["executor"] = RayExecutor(ray)
    try:
        with sigterm_as_interrupt():
            outcome = run_sweep(cfg, run_dir, resume=resume, only=only, progress=True if progress else None,
                                parallel=parallel, devices=device_ids, **extra)
    except SweepConfigError as e:
        raise UserError(str(e)) from None
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: say exactly how to finish the run
        for line in interrupted_lines(again):
            typer.echo(line, err=True)
        raise typer.Exit(143 if isinstance(e, SweepTerminated) else 130) from None
    typer.echo(
        f"{run_dir}: {len(outcome.done)} cells done, {len(outcome.failed)} failed, "
        f"{len(outcome.skipped)} already done (skipped)"
    )
    if outcome.failed:
        typer.echo(f"failed cells (see {run_dir}/cells/<key>/summary.json and error.txt):", err=True)
        for key in outcome.failed:
            typer.echo(f"  {key}", err=True)
        typer.echo(f"redo the failed cells with:\n  {again}", err=True)
        raise typer.Exit(1)
    report, gate = finished_commands(run_dir)
    typer.echo(f"next: {report}   (tables and plots)\n      {gate}   (pass/fail against the config's gate)")
