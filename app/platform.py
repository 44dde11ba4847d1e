"""The platform at a glance, for its admins: how far the read models trail
the ledger, what the last scheduled ledger verification found, how many
workers are in each state and how many accounts of each kind there are."""
from __future__ import annotations

from sqlalchemy import Engine

from invoices import read_models
from ledger import accounts as acc
from ledger.verify_since import last_result
from proxy import workers as registry


def platform_status(engine: Engine) -> dict:
    projections = {"consumer": read_models.CONSUMER, "lag_events": read_models.lag_events(engine),
                   "lag_s": read_models.lag_seconds(engine)}
    with engine.connect() as conn:
        return {"projections": projections, "ledger_verify": last_result(conn),
                "workers_by_state": registry.count_by_state(conn), "accounts_by_kind": acc.count_by_kind(conn)}
