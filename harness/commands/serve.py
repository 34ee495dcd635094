"""`kvbench serve`: the embedded engine behind an OpenAI-compatible HTTP server (docs/design.md §7).

    kvbench serve                                   # default model on CPU, http://127.0.0.1:8000/v1
    kvbench serve --model synthetic:llama-3-8b --kv-dtype fp8_e4m3 --kv-scales calibrate --port 8001

Binds 127.0.0.1 unless ``--host`` says otherwise; every engine flag applies.  The port is checked before the
model loads: a busy one is a one-line error (exit 2) at once.  ``--max-body-mb`` caps a
request body (default: 64 bytes per token of context, at least 8 MiB); a larger one gets a 413.
"""

from __future__ import annotations

import errno
import socket
from typing import Optional

import typer

from kvbench.harness.options import engine_options


def _user_error(msg: str) -> Exception:
    try:
        from kvbench.harness.errors import UserError
    except ImportError:  # pragma: no cover - older trees without harness/errors.py
        return typer.BadParameter(msg)
    return UserError(msg)


def check_port_free(host: str, port: int) -> None:
    """Bind ``host:port`` once and let it go, before anything loads: a port in use (or an address this host
    does not have) is a one-line user error naming the port, raised in well under a second.  Port 0 (any
    free port) needs no check.  ``SO_REUSEADDR`` as the server sets it, so a port in TIME_WAIT is free."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise _user_error(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise _user_error(f"port {port} on {host} is already in use (another server?); stop it or pass "
                                  f"another --port, e.g. --port {port + 1 if port < 65535 else 8001}") from None
            if e.errno == errno.EACCES:
                raise _user_error(f"port {port} on {host}: permission denied (ports below 1024 need privileges); "
                                  "pass --port 1024 or above") from None
            raise _user_error(f"cannot bind {host}:{port}: {e.strerror or e}; check --host and --port") from None


def register(app: typer.Typer) -> None:
    @app.command("serve", help="Serve the embedded engine over an OpenAI-compatible HTTP API.")
    @engine_options
    def serve(
        engine,
        host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default: loopback only)"),
        port: int = typer.Option(8000, "--port", help="TCP port", min=0, max=65535),
        log_level: str = typer.Option("warning", "--log-level", help="uvicorn log level"),
        max_body_mb: Optional[float] = typer.Option(
            None, "--max-body-mb", min=0.001,
            help="Largest request body in MiB; larger ones get a 413 (default: 64 bytes per token of context, at least 8)"),
    ) -> None:
        if host not in ("127.0.0.1", "localhost", "::1"):
            typer.echo(f"warning: binding {host}: the server has no authentication", err=True)
        check_port_free(host, port)  # before the model loads: a busy port fails at once
        from kvbench.runtime import run_server

        limit = None if max_body_mb is None else int(max_body_mb * 2**20)
        run_server(engine, host=host, port=port, log_level=log_level, max_body_bytes=limit)
