"""`paralon platform`: the whole platform at a glance, for its operators."""
from __future__ import annotations

import click

from app.cli.output import emit, engine, handles_errors, json_option
from app.platform import platform_status


@click.group("platform")
def platform_group() -> None:
    """The platform as a whole."""


@platform_group.command("status")
@json_option
@handles_errors
def platform_status_command(as_json: bool) -> None:
    """Read-model lag, the last scheduled ledger verification, workers by state, accounts by kind (GET /v1/platform/status)."""
    status = platform_status(engine())
    verify = status["ledger_verify"]
    verdict = {None: "not run yet", True: "ok", False: f"FAILED ({verify['problems_total']} problems)"}[verify["ok"]]
    lines = [f"read models: {status['projections']['lag_events']} events behind",
             f"ledger verify: {verdict}, proven through event {verify['verified_seq']}"
             + (f" at {verify['checked_at']}" if verify["checked_at"] else ""),
             "workers: " + ", ".join(f"{state} {n}" for state, n in status["workers_by_state"].items()),
             "accounts: " + ", ".join(f"{kind} {n}" for kind, n in status["accounts_by_kind"].items())]
    emit(as_json, status, "\n".join(lines))


COMMANDS = (platform_group,)
