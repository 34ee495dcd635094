"""`kvbench serve`: the embedded engine behind an OpenAI-compatible HTTP server (DESIGN §7).

    kvbench serve                                   # default model on CPU, http://127.0.0.1:8000/v1
    kvbench serve --model synthetic:llama-3-8b --kv-dtype fp8_e4m3 --kv-scales calibrate --port 8001

Binds 127.0.0.1 unless ``--host`` says otherwise; every engine flag applies.  ``--max-body-mb`` caps a
request body (default: 64 bytes per token of context, at least 8 MiB); a larger one gets a 413.
"""

from __future__ import annotations

from typing import Optional

import typer

from kvbench.harness.options import engine_options


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
        from kvbench.runtime.server import run_server

        limit = None if max_body_mb is None else int(max_body_mb * 2**20)
        run_server(engine, host=host, port=port, log_level=log_level, max_body_bytes=limit)
