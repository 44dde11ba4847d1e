"""The worker registry: who serves which model where, and in what state.

State (active, draining, drained, suspended) is written only by an operator's
drain or resume, or by the usage check; heartbeats write health columns and
nothing else, so a heartbeat can never undo a drain.

Strikes (DESIGN.md, Metering rules): nothing a caller sends may get an honest
worker suspended, so a strike needs proof on one request (more completion
reported than the proxy relayed, malformed choices), or the same inflation on
requests of several customer accounts. The evidence is read from the database,
so every replica decides on all of it; a suspension and a resumption change
the worker and append their event in one transaction."""
from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import NamedTuple
from urllib.parse import urlsplit

from sqlalchemy import Connection, func, select, update

from ledger import commands as cmd
from ledger.accounts import require_kind
from ledger.errors import InvalidInput
from ledger.schema import utc_now
from ledger.store import CREATED, AppendResult, append_one
from proxy.capacity import Capacity
from proxy.errors import InvalidRequest
from proxy.limits import (
    DRAIN_DEADLINE_S,
    NAME_CHARS_MAX,
    PREFIX_CACHE_HIT_RATE_DECIMALS,
    PROMPT_INFLATION_ACCOUNTS_MIN,
    PROMPT_INFLATION_WINDOW_S,
    USAGE_STRIKES_MAX,
)
from proxy.schema import WORKER_STATES, WORKER_TASKS, usage_evidence, workers

ENGINES = ("vllm", "llamacpp")
CHAT, EMBEDDING = WORKER_TASKS
ROUTES_OF_TASK = {CHAT: "/v1/chat/completions and /v1/completions", EMBEDDING: "/v1/embeddings"}
# A report above the prompt bound may be the caller's doing (a field the engine
# obeys, a template the bound misjudges): it is a strike only once requests of
# PROMPT_INFLATION_ACCOUNTS_MIN different accounts show it within the window.
PROMPT_ABOVE_BOUND = "prompt_above_bound"
# Reasons whose evidence counts only across accounts; any other reason either
# proves dishonesty on its own (`proof=True`) or is only recorded.
CROSS_ACCOUNT_REASONS = (PROMPT_ABOVE_BOUND,)
# A report above the bound that a caller could have caused (a stream that did
# not finish): recorded as evidence, never a strike.
USAGE_ABOVE_BOUND_UNPROVEN = "usage_above_bound_unproven"


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
    suspended_at: datetime | None
    suspension_reason: str | None
    task: str = CHAT  # what it serves: chat (and completions) or embeddings
    capacity_saturated: bool = False  # throughput_tokens_per_s was measured while it queued (proxy/capacity.py)
    capacity_requests: int | None = None  # the batch it ran then
    capacity_measured_at: datetime | None = None
    relayed_tokens_total: int = 0  # by every replica
    long_prompts_until: datetime | None = None  # room is kept on it for long prompts until then
    prefix_cache_hits_tokens: int | None = None  # the worker's own counters, as last scraped
    prefix_cache_queries_tokens: int | None = None

    def as_dict(self, now: datetime | None = None) -> dict:
        """The row, and what follows from it at `now`: the seconds a draining
        worker has left and its prefix-cache hit rate."""
        data = self._asdict()
        for name in ("created_at", "drain_requested_at", "last_heartbeat_at", "suspended_at", "capacity_measured_at",
                     "long_prompts_until"):
            data[name] = data[name].isoformat() if data[name] else None
        data["drain_seconds_left"] = self.drain_seconds_left(now or utc_now())
        data["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate()
        return data

    def drain_seconds_left(self, now: datetime) -> int | None:
        """While draining, the whole seconds until the health check declares it
        drained at the latest (sooner once nothing runs on it); else None."""
        if self.state != "draining" or self.drain_requested_at is None:
            return None
        elapsed_s = (now - self.drain_requested_at).total_seconds()
        return max(0, math.ceil(DRAIN_DEADLINE_S - elapsed_s))

    def prefix_cache_hit_rate(self) -> float | None:
        """Cached prompt tokens over prompt tokens looked up, since the worker's
        engine started (its own counters); None when it reports none or has
        looked nothing up yet. A worker reporting more hits than queries is
        shown at 1: the figure is the owner's to read, it moves no traffic."""
        hits, queries = self.prefix_cache_hits_tokens, self.prefix_cache_queries_tokens
        if hits is None or not queries:
            return None
        return round(min(1.0, max(0, hits) / queries), PREFIX_CACHE_HIT_RATE_DECIMALS)


_COLUMNS = [workers.c[name] for name in WorkerView._fields]


class UnknownWorker(InvalidInput):
    code = "unknown_worker"


class WorkerNotSuspended(InvalidInput):
    code = "worker_not_suspended"


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
               context_length: int | None = None, task: str = CHAT) -> int:
    require_kind(conn, owner_account_id, (cmd.OWNER,), "workers belong to owner accounts")
    if engine not in ENGINES:
        raise InvalidInput(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if task not in WORKER_TASKS:
        raise InvalidInput(f"task must be one of {', '.join(WORKER_TASKS)}, got {task!r}")
    cmd.require_text(model, "a model name", NAME_CHARS_MAX)
    if context_length is not None and (type(context_length) is not int or context_length <= 0):
        raise InvalidInput("context length must be a positive number of tokens")
    if engine == "llamacpp" and context_length is None:
        raise InvalidInput("llama.cpp does not report its context length: pass --context-length (its n_ctx)")
    return conn.execute(
        workers.insert()
        .values(owner_account_id=owner_account_id, url=require_url(url), model=model, engine=engine,
                context_length=context_length, task=task, created_at=utc_now())
        .returning(workers.c.id)
    ).scalar_one()


def for_task(fleet: list[WorkerView] | None, task: str, model: str) -> list[WorkerView]:
    """The model's workers that serve this task. A model whose workers all
    serve the other task is a clear 400 naming its route, not an unknown model."""
    serving = [w for w in fleet or () if w.task == task]
    if fleet and not serving:
        other = fleet[0].task
        raise InvalidRequest(f"`{model}` is {'an embedding' if other == EMBEDDING else 'a chat'} model: "
                             f"it is served at {ROUTES_OF_TASK[other]}", param="model")
    return serving


def list_workers(conn: Connection, *, owner_account_id: int | None = None) -> list[WorkerView]:
    query = select(*_COLUMNS).order_by(workers.c.id)
    if owner_account_id is not None:
        query = query.where(workers.c.owner_account_id == owner_account_id)
    return [WorkerView(*row) for row in conn.execute(query)]


def count_by_state(conn: Connection) -> dict[str, int]:
    """Workers in each state (every state named, 0 when none), and how many active ones answer their health checks."""
    counts = dict.fromkeys(WORKER_STATES, 0)
    counts.update(conn.execute(select(workers.c.state, func.count()).group_by(workers.c.state)).all())
    healthy = conn.execute(select(func.count()).where(workers.c.state == "active", workers.c.healthy)).scalar_one()
    return {**counts, "active_healthy": healthy}


def get_worker(conn: Connection, worker_id: int, *, lock: bool = False) -> WorkerView:
    """The worker's row; with `lock`, locked until the caller's transaction ends."""
    query = select(*_COLUMNS).where(workers.c.id == worker_id)
    row = conn.execute(query.with_for_update() if lock else query).first()
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


def record_heartbeat(conn: Connection, worker_id: int, *, healthy: bool | None, context_length: int | None = None,
                     served_model: str | None = None, relayed_tokens: int = 0,
                     prefix_cache: tuple[int | None, int | None] | None = None) -> None:
    """Health, and the tokens this replica relayed since its last heartbeat
    (added to every replica's): this statement has no `state` in it, on purpose.
    `prefix_cache`: (hits, queries) as the worker's metrics said, None where
    they said nothing; left as it is when not given. `healthy` None leaves
    the health as it was."""
    values: dict = {} if healthy is None else {"healthy": healthy}
    if prefix_cache is not None:
        values["prefix_cache_hits_tokens"], values["prefix_cache_queries_tokens"] = prefix_cache
    if relayed_tokens:
        values["relayed_tokens_total"] = workers.c.relayed_tokens_total + relayed_tokens
    if healthy:
        values["last_heartbeat_at"] = utc_now()
    if context_length is not None:
        values["context_length"] = context_length
    if served_model is not None:
        values["served_model"] = served_model
    if values:
        conn.execute(update(workers).where(workers.c.id == worker_id).values(**values))


def record_capacity(conn: Connection, worker: WorkerView, capacity: Capacity, now: datetime) -> bool:
    """Store a worker's capacity unless another replica stored one since this
    replica read the row: one writer per period, and each new value built on
    the one before it. False when another replica was first."""
    measured_at = workers.c.capacity_measured_at
    unchanged = measured_at.is_(None) if worker.capacity_measured_at is None else measured_at == worker.capacity_measured_at
    return bool(conn.execute(
        update(workers).where(workers.c.id == worker.id, unchanged)
        .values(throughput_tokens_per_s=capacity.tokens_per_s, capacity_saturated=capacity.saturated,
                capacity_requests=capacity.requests, capacity_measured_at=now)
    ).rowcount)


def keep_room_for_long_prompts(conn: Connection, worker_ids: list[int], until: datetime) -> None:
    """These workers alone held a long prompt: every replica keeps room on them until then."""
    conn.execute(update(workers).where(workers.c.id.in_(worker_ids)).values(long_prompts_until=until))


class StrikeOutcome(NamedTuple):
    recorded: bool  # False: this request's discrepancy was recorded before
    struck: bool
    suspended: bool


def record_usage_discrepancy(conn: Connection, discrepancy: cmd.RecordUsageDiscrepancy, *, proof: bool) -> StrikeOutcome:
    """Record a usage report above the proxy's count (its event and its
    evidence) and the strike and suspension it leads to, in the caller's
    transaction. `proof`: this request alone shows the worker dishonest.
    Recording the same request again changes nothing."""
    worker_id, request_id = discrepancy.worker_id, discrepancy.request_id
    _lock_worker(conn, worker_id)
    if conn.execute(select(usage_evidence.c.request_id).where(usage_evidence.c.request_id == request_id)).first():
        return StrikeOutcome(False, False, False)
    appended = _append(conn, discrepancy)
    if appended.status != CREATED:
        return StrikeOutcome(False, False, False)
    now = utc_now()
    state = "struck" if proof else "pending" if discrepancy.reason in CROSS_ACCOUNT_REASONS else "cleared"
    conn.execute(usage_evidence.insert().values(
        request_id=request_id, worker_id=worker_id, customer_account_id=discrepancy.customer_account_id,
        reason=discrepancy.reason, state=state, recorded_at=now, ledger_seq=appended.seq))
    if state == "cleared":
        return StrikeOutcome(True, False, False)
    if state == "pending" and not _strike_across_accounts(conn, worker_id, discrepancy.reason, now):
        return StrikeOutcome(True, False, False)
    return StrikeOutcome(True, True, _add_strike(conn, worker_id, request_id, now))


def _strike_across_accounts(conn: Connection, worker_id: int, reason: str, now: datetime) -> bool:
    """When pending evidence of this reason spans enough accounts within the
    window, the oldest piece of each account becomes one strike (and counts
    for no other). One piece per account, so that the strikes do not depend
    on the order in which concurrent settlements are recorded."""
    pending = conn.execute(
        select(usage_evidence.c.request_id, usage_evidence.c.customer_account_id)
        .where(usage_evidence.c.worker_id == worker_id, usage_evidence.c.state == "pending",
               usage_evidence.c.reason == reason,
               usage_evidence.c.recorded_at >= now - timedelta(seconds=PROMPT_INFLATION_WINDOW_S))
        .order_by(usage_evidence.c.recorded_at, usage_evidence.c.request_id)
    ).all()
    oldest_per_account: dict[int, str] = {}
    for request_id, account_id in pending:
        oldest_per_account.setdefault(account_id, request_id)
    if len(oldest_per_account) < PROMPT_INFLATION_ACCOUNTS_MIN:
        return False
    conn.execute(update(usage_evidence).where(usage_evidence.c.request_id.in_(oldest_per_account.values()))
                 .values(state="struck"))
    return True


def _add_strike(conn: Connection, worker_id: int, request_id: str, now: datetime) -> bool:
    """One more strike; True when it suspends the worker."""
    conn.execute(update(workers).where(workers.c.id == worker_id).values(usage_strikes=workers.c.usage_strikes + 1))
    worker = get_worker(conn, worker_id)
    if worker.state != "active" or worker.usage_strikes < USAGE_STRIKES_MAX:
        return False
    struck = conn.execute(  # the latest evidence, in the order it was recorded
        select(usage_evidence.c.request_id, usage_evidence.c.reason)
        .where(usage_evidence.c.worker_id == worker_id, usage_evidence.c.state == "struck")
        .order_by(usage_evidence.c.recorded_at.desc(), usage_evidence.c.request_id.desc())
        .limit(cmd.EVIDENCE_REQUEST_IDS_MAX)
    ).all()[::-1]
    reason = f"{worker.usage_strikes} usage strikes: {', '.join(sorted({r.reason for r in struck}))}"
    conn.execute(update(workers).where(workers.c.id == worker_id)
                 .values(state="suspended", suspended_at=now, suspension_reason=reason))
    _append(conn, cmd.RecordWorkerSuspension(worker_id, reason, worker.usage_strikes, tuple(r.request_id for r in struck),
                                             f"worker-suspended:{worker_id}:{request_id}"))
    return True


def resume_worker(conn: Connection, worker_id: int, *, resumed_by: str, reason: str) -> WorkerView:
    """Return a suspended worker to routing with no strikes; its event says who and why.
    A draining or drained worker stays as it is (an error)."""
    worker = _lock_worker(conn, worker_id)
    if worker.state != "suspended":
        raise WorkerNotSuspended(f"worker {worker_id} is {worker.state}, not suspended: only a suspended worker is resumed")
    suspended_at = worker.suspended_at.isoformat() if worker.suspended_at else "unrecorded"
    command = cmd.RecordWorkerResumption(worker_id, resumed_by, reason, worker.usage_strikes,
                                         f"worker-resumed:{worker_id}:{suspended_at}")
    cmd.validate_shape(command)
    conn.execute(update(workers).where(workers.c.id == worker_id)
                 .values(state="active", usage_strikes=0, suspended_at=None, suspension_reason=None))
    conn.execute(update(usage_evidence).where(usage_evidence.c.worker_id == worker_id, usage_evidence.c.state != "cleared")
                 .values(state="cleared"))  # evidence from before the resumption counts no more
    _append(conn, command)
    return get_worker(conn, worker_id)


def _lock_worker(conn: Connection, worker_id: int) -> WorkerView:
    """Strikes of one worker are decided one at a time, across replicas."""
    return get_worker(conn, worker_id, lock=True)


def _append(conn: Connection, command: cmd.Command) -> AppendResult:
    """A ledger event in the caller's transaction, with the worker's change it records."""
    cmd.validate_shape(command)
    return append_one(conn, command)
