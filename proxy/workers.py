"""The worker registry: who serves which model where, and in what state.

State (active, draining, drained, suspended) is written only by an operator's
drain or by the usage check; heartbeats write health columns and nothing
else, so a heartbeat can never undo a drain."""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import NamedTuple
from urllib.parse import urlsplit

from sqlalchemy import Connection, select, update

from ledger import commands as cmd
from ledger.accounts import require_kind
from ledger.errors import InvalidInput
from ledger.schema import utc_now
from proxy.schema import workers

ENGINES = ("vllm", "llamacpp")
DRAIN_DEADLINE_S = 120
USAGE_STRIKES_MAX = 3


class WorkerView(NamedTuple):
    id: int
    owner_account_id: int
    url: str
    model: str
    engine: str
    state: str
    context_length: int | None
    served_model: str | None
    healthy: bool
    throughput_tokens_per_s: int | None
    created_at: datetime
    drain_requested_at: datetime | None
    last_heartbeat_at: datetime | None
    usage_strikes: int

    def as_dict(self) -> dict:
        data = self._asdict()
        for name in ("created_at", "drain_requested_at", "last_heartbeat_at"):
            data[name] = data[name].isoformat() if data[name] else None
        return data


_COLUMNS = [workers.c[name] for name in WorkerView._fields]


class UnknownWorker(InvalidInput):
    code = "unknown_worker"


def require_url(url: str) -> str:
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidInput(f"worker URL must be http(s)://host[:port], got {url!r}")
    try:
        parts.port
    except ValueError:
        raise InvalidInput(f"worker URL has a bad port: {url!r}") from None
    return url.strip().rstrip("/")


def add_worker(conn: Connection, owner_account_id: int, url: str, model: str, engine: str = "vllm",
               context_length: int | None = None) -> int:
    require_kind(conn, owner_account_id, (cmd.OWNER,), "workers belong to owner accounts")
    if engine not in ENGINES:
        raise InvalidInput(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    cmd.require_text(model, "a model name", 200)
    if context_length is not None and (type(context_length) is not int or context_length <= 0):
        raise InvalidInput("context length must be a positive number of tokens")
    if engine == "llamacpp" and context_length is None:
        raise InvalidInput("llama.cpp does not report its context length: pass --context-length (its n_ctx)")
    return conn.execute(
        workers.insert()
        .values(owner_account_id=owner_account_id, url=require_url(url), model=model, engine=engine,
                context_length=context_length, created_at=utc_now())
        .returning(workers.c.id)
    ).scalar_one()


def list_workers(conn: Connection, *, owner_account_id: int | None = None) -> list[WorkerView]:
    query = select(*_COLUMNS).order_by(workers.c.id)
    if owner_account_id is not None:
        query = query.where(workers.c.owner_account_id == owner_account_id)
    return [WorkerView(*row) for row in conn.execute(query)]


def get_worker(conn: Connection, worker_id: int) -> WorkerView:
    row = conn.execute(select(*_COLUMNS).where(workers.c.id == worker_id)).first()
    if row is None:
        raise UnknownWorker(f"worker {worker_id} does not exist")
    return WorkerView(*row)


def drain_worker(conn: Connection, worker_id: int) -> WorkerView:
    """No new requests from now on; in-flight ones finish. Idempotent."""
    get_worker(conn, worker_id)
    conn.execute(
        update(workers).where(workers.c.id == worker_id, workers.c.state.in_(("active", "suspended")))
        .values(state="draining", drain_requested_at=utc_now())
    )
    return get_worker(conn, worker_id)


def mark_drained(conn: Connection, worker_id: int) -> bool:
    return bool(conn.execute(
        update(workers).where(workers.c.id == worker_id, workers.c.state == "draining").values(state="drained", drained_at=utc_now())
    ).rowcount)


def drain_overdue(worker: WorkerView, now: datetime) -> bool:
    return worker.drain_requested_at is not None and now - worker.drain_requested_at >= timedelta(seconds=DRAIN_DEADLINE_S)


def record_heartbeat(conn: Connection, worker_id: int, *, healthy: bool, context_length: int | None = None,
                     served_model: str | None = None) -> None:
    """Health only: this statement has no `state` in it, on purpose."""
    values: dict = {"healthy": healthy}
    if healthy:
        values["last_heartbeat_at"] = utc_now()
    if context_length is not None:
        values["context_length"] = context_length
    if served_model is not None:
        values["served_model"] = served_model
    conn.execute(update(workers).where(workers.c.id == worker_id).values(**values))


def record_throughput(conn: Connection, worker_id: int, tokens_per_s: int, *, only_if_unmeasured: bool = False) -> None:
    statement = update(workers).where(workers.c.id == worker_id)
    if only_if_unmeasured:
        statement = statement.where(workers.c.throughput_tokens_per_s.is_(None))
    conn.execute(statement.values(throughput_tokens_per_s=tokens_per_s))


def add_usage_strike(conn: Connection, worker_id: int) -> bool:
    """One more inflated usage report; True when the worker is now suspended."""
    conn.execute(update(workers).where(workers.c.id == worker_id).values(usage_strikes=workers.c.usage_strikes + 1))
    suspended = conn.execute(
        update(workers)
        .where(workers.c.id == worker_id, workers.c.state == "active", workers.c.usage_strikes >= USAGE_STRIKES_MAX)
        .values(state="suspended")
    ).rowcount
    return bool(suspended)
