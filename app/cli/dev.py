"""Trying Paralon out: `paralon up` (the whole service on the embedded default,
what `make run` starts) and `paralon demo` (a scripted tour of the ledger)."""
from __future__ import annotations

import click

from app.cli.demo import run_demo
from app.cli.output import handles_errors
from app.cli.up import DEMO_WORKER_PORTS, run_up
from app.limits import SERVE_PORT_DEFAULT, TCP_PORT_MAX
from app.settings import Settings
from ledger.db import make_engine


@click.command("up")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=SERVE_PORT_DEFAULT, show_default=True, type=click.IntRange(1, TCP_PORT_MAX))
@click.option("--worker-ports", default=tuple(port for _, port in DEMO_WORKER_PORTS), show_default=True, type=(int, int),
              help="Ports of the two simulated workers (h200, 2x4090).")
@handles_errors
def up_command(host: str, port: int, worker_ports: tuple[int, int]) -> None:
    """The embedded default: SQLite, two simulated workers, a demo customer and key, the proxy."""
    run_up(host, port, worker_ports)


@click.command("demo")
@handles_errors
def demo_command() -> None:
    """A short scripted tour of the ledger on the configured database."""
    settings = Settings.from_env()
    run_demo(make_engine(settings.database.url), settings)


COMMANDS = (up_command, demo_command)
