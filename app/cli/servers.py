"""The processes that run until stopped: `paralon serve` (the proxy),
`sim-worker` (a simulated GPU worker), and Celery's `worker` and `beat`."""
from __future__ import annotations

import click

from app.cli.output import handles_errors
from app.http.server import run_server
from app.jobs.celery import celery
from app.settings import Settings
from proxy.sim.worker import serve as serve_sim

SIM_PROFILES = ("instant", "h200", "rtx-pro-6000", "2x4090", "2x5090")


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@handles_errors
def serve_command(host: str, port: int) -> None:
    """Run the OpenAI-compatible proxy (docs at /docs)."""
    run_server(Settings.from_env(), host, port)


@click.command("sim-worker")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", required=True, type=click.IntRange(1, 65535))
@click.option("--profile", type=click.Choice(SIM_PROFILES), default="instant", show_default=True)
@click.option("--model", default="paralon-demo", show_default=True)
def sim_worker_command(host: str, port: int, profile: str, model: str) -> None:
    """A simulated GPU worker speaking vLLM's OpenAI API."""
    serve_sim(host, port, profile, model)


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


COMMANDS = (serve_command, sim_worker_command, worker_command, beat_command)
