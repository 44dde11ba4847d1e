"""What a GPU owner sees of each worker: its row (state, seconds left of a
drain, suspension reason, measured capacity, prefix-cache hit rate) and its
share of its model's requests over the last 24 hours.

The share is counted from the read models' postings (invoices/schema.py
`account_postings`): every settled request posts once to the platform's
revenue account, with its model and the worker that served it, so the
postings there in the window are the model's requests across every owner.
Requests, not tokens: postings carry no token counts, `earnings_daily` has
only whole UTC days (not the last 24 hours), and `relayed_tokens_total`
counts since the worker was added. A request settled in two parts counts
once (by its request id); a settlement later reversed (an answer withheld)
still counts, since the worker did serve it. The read models follow the log
within seconds, so the latest requests may be missing for that long."""
from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta

from sqlalchemy import Connection, func, select

from app.limits import TRAFFIC_SHARE_DECIMALS, TRAFFIC_SHARE_WINDOW_S
from invoices.schema import account_postings
from ledger.commands import PLATFORM_REVENUE_ACCOUNT
from ledger.schema import accounts, utc_now
from proxy import workers as registry

SETTLED = "RequestSettled"


def worker_rows(conn: Connection, views: list[registry.WorkerView], now: datetime | None = None) -> list[dict]:
    """Each worker as its owner sees it, with `requests_24h` and
    `traffic_share_24h` (0 to 1; None when its model had no requests)."""
    now = now or utc_now()
    served = requests_by_worker(conn, {view.model for view in views}, now - timedelta(seconds=TRAFFIC_SHARE_WINDOW_S))
    model_total: dict[str, int] = defaultdict(int)
    for (model, _), requests in served.items():
        model_total[model] += requests
    rows = []
    for view in views:
        requests, total = served.get((view.model, view.id), 0), model_total[view.model]
        share = round(requests / total, TRAFFIC_SHARE_DECIMALS) if total else None
        rows.append({**view.as_dict(now), "requests_24h": requests, "traffic_share_24h": share})
    return rows


def requests_by_worker(conn: Connection, models: set[str], since: datetime) -> dict[tuple[str, int], int]:
    """(model, worker id) -> requests settled since then, for these models."""
    if not models:
        return {}
    platform = select(accounts.c.id).where(accounts.c.system_code == PLATFORM_REVENUE_ACCOUNT).scalar_subquery()
    p = account_postings.c
    rows = conn.execute(
        select(p.model, p.worker_id, func.count(p.reference.distinct()))
        .where(p.account_id == platform, p.recorded_at >= since, p.event_type == SETTLED, p.model.in_(sorted(models)))
        .group_by(p.model, p.worker_id)
    )
    return {(model, worker_id): int(requests) for model, worker_id, requests in rows}
