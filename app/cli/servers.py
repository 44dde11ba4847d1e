"""The processes of a deployment that run until stopped: `paralon serve` (the
proxy) and Celery's `worker` and `beat`."""
from __future__ import annotations

import click

from app.cli.output import handles_errors
from app.http.server import run_server
from app.jobs.celery import celery
from app.limits import SERVE_PORT_DEFAULT, TCP_PORT_MAX
from app.settings import Settings


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=SERVE_PORT_DEFAULT, show_default=True, type=click.IntRange(1, TCP_PORT_MAX))
@handles_errors
def serve_command(host: str, port: int) -> None:
    """Run the OpenAI-compatible proxy (docs at /docs)."""
    run_server(Settings.from_env(), host, port)


@click.command("worker", context_settings={"ignore_unknown_options": True})
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
def worker_command(celery_args) -> None:
    """A Celery worker (PARALON_CELERY_BROKER_URL); extra arguments go to Celery."""
    celery.worker_main(["worker", "--loglevel=INFO", *celery_args])


@click.command("beat", context_settings={"ignore_unknown_options": True})
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
def beat_command(celery_args) -> None:
    """The scheduler (exactly one per deployment): the deposit scan, and later the monthly statements."""
    celery.start(["beat", "--loglevel=INFO", *celery_args])


COMMANDS = (serve_command, worker_command, beat_command)
