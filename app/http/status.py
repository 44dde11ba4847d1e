"""For operators: liveness, readiness, and Prometheus metrics (read-model
lag) from a registry of this app's own, so two apps in one process never
share series."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

from litestar import Request, Response, get
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
import redis
from sqlalchemy import Engine, select, text

from app.http.plumbing import json_response
from app.limits import READY_CHECK_TIMEOUT_S, READY_READ_MODEL_LAG_S_MAX
from app.payments.schema import payout_wallets
from app.payments.stripe import parked_count
from invoices import read_models
from ledger.limits import MS_PER_S
from ledger.schema import ledger_verifications
from proxy.directory import Directory
from proxy.limits import DATABASE_RETRY_AFTER_S

LAG_METRIC = "paralon_projection_lag_events"
LAG_HELP = "Events the read models have not applied yet."
LAG_S_METRIC = "paralon_projection_lag_seconds"
LAG_S_HELP = "Age of the oldest event the read models have not applied yet (0 when none); bound: READ_MODELS_LAG_S_MAX."


class ReadModelLag(Collector):
    """Measured at each scrape (one query), never cached."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(LAG_METRIC, LAG_HELP, labels=["consumer"])
        yield GaugeMetricFamily(LAG_S_METRIC, LAG_S_HELP, labels=["consumer"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily(LAG_METRIC, LAG_HELP, labels=["consumer"])
        gauge.add_metric([read_models.CONSUMER], read_models.lag_events(self.engine))
        yield gauge
        seconds = GaugeMetricFamily(LAG_S_METRIC, LAG_S_HELP, labels=["consumer"])
        seconds.add_metric([read_models.CONSUMER], read_models.lag_seconds(self.engine))
        yield seconds


VERIFY_OK_METRIC = "paralon_ledger_verify_ok"
VERIFIED_SEQ_METRIC = "paralon_ledger_verified_seq"
VERIFY_PROBLEMS_METRIC = "paralon_ledger_verify_problems"


class LedgerVerification(Collector):
    """What the scheduled verification last found (app/jobs/ledger_check.py); nothing before its first run."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        v = ledger_verifications.c
        with self.engine.connect() as conn:
            row = conn.execute(select(v.ok, v.verified_seq, v.problems_total).where(v.id == 1, v.ok.is_not(None))).one_or_none()
        if row is None:
            return
        yield GaugeMetricFamily(VERIFY_OK_METRIC, "1 when the last scheduled ledger verification passed, else 0.", value=int(row.ok))
        yield GaugeMetricFamily(VERIFIED_SEQ_METRIC, "The last event whose hash chain is proven.", value=row.verified_seq)
        yield GaugeMetricFamily(VERIFY_PROBLEMS_METRIC, "Problems the last scheduled verification found.", value=row.problems_total)


class StripeParked(Collector):
    """Stripe events that failed and are not processed yet (`paralon stripe failed`)."""

    NAME, HELP = "paralon_stripe_parked_events", "Stripe webhook events parked after failing to process."

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, self.HELP)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, self.HELP, value=parked_count(self.engine))


WAITING_FOR_FUNDS_METRIC = "paralon_payouts_waiting_for_funds"
WALLET_TOKEN_METRIC = "paralon_payout_wallet_token_balance_raw"
WALLET_GAS_METRIC = "paralon_payout_wallet_gas_balance_wei"


class PayoutWallets(Collector):
    """What the USDC sender's last run found in each hot wallet (app/payments/payout_chain.py):
    payouts it could not pay for want of tokens or gas, and the balances it read."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["chain_id", "address"]
        waiting = GaugeMetricFamily(WAITING_FOR_FUNDS_METRIC, "USDC payouts waiting in requested because the hot wallet "
                                    "cannot cover their tokens or gas (at the sender's last run).", labels=labels)
        token = GaugeMetricFamily(WALLET_TOKEN_METRIC, "The hot wallet's payout token, in its smallest unit.", labels=labels)
        gas = GaugeMetricFamily(WALLET_GAS_METRIC, "The hot wallet's gas balance, in wei.", labels=labels)
        w = payout_wallets.c
        with self.engine.connect() as conn:
            rows = conn.execute(select(w.chain_id, w.address, w.payouts_waiting_for_funds, w.token_balance_raw,
                                       w.gas_balance_wei).where(w.balances_at.is_not(None))).all()
        for row in rows:
            wallet = [str(row.chain_id), row.address]
            waiting.add_metric(wallet, row.payouts_waiting_for_funds)
            token.add_metric(wallet, int(row.token_balance_raw))
            gas.add_metric(wallet, int(row.gas_balance_wei))
        yield from (waiting, token, gas)


SPILLS_METRIC = "paralon_route_spills"  # exposed as paralon_route_spills_total
CAPACITY_METRIC = "paralon_worker_capacity_tokens_per_s"


class RoutingState(Collector):
    """This replica's spills, and the capacity every replica routes on (proxy/capacity.py)."""

    def __init__(self, directory: Directory) -> None:
        self.directory = directory

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        spills = CounterMetricFamily(SPILLS_METRIC, "Requests this replica sent past their affinity choice, by reason.",
                                     labels=["model", "reason"])
        for (model, reason), count in sorted(self.directory.spills.items()):
            spills.add_metric([model, reason], count)
        yield spills
        measured = GaugeMetricFamily(CAPACITY_METRIC, "Output tokens per second a worker delivered: at saturation when "
                                     "saturated is 1, else the most it delivered so far.", labels=["worker_id", "saturated"])
        for workers in self.directory.fleet.values():
            for worker in workers:
                if worker.throughput_tokens_per_s:
                    measured.add_metric([str(worker.id), str(int(worker.capacity_saturated))], worker.throughput_tokens_per_s)
        yield measured


def metrics_registry(engine: Engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReadModelLag(engine))
    registry.register(LedgerVerification(engine))
    registry.register(StripeParked(engine))
    registry.register(PayoutWallets(engine))
    return registry


@get("/metrics", summary="Prometheus metrics: read-model lag, the scheduled ledger verification, parked Stripe events")
async def metrics(request: Request) -> Response:
    text = await asyncio.to_thread(generate_latest, request.app.state.metrics)  # the collectors query the database
    return Response(text, media_type=CONTENT_TYPE_LATEST)


@get("/health", summary="Liveness")
async def health() -> Response:
    return json_response({"status": "ok"})


@get("/ready", summary="Readiness: the database answers, Redis too when configured, the read models keep up",
     description="200 when this replica can serve; 503 with Retry-After and the failed checks named otherwise. "
                 "A load balancer sends traffic only to ready replicas; /health says only that the process is alive.")
async def ready(request: Request) -> Response:
    checks = {"database": await _check(_database_answers, request.app.state.ledger.engine)}
    redis_url = request.app.state.redis_url
    if redis_url:
        checks["redis"] = await _check(_redis_answers, redis_url)
    if checks["database"]["ok"]:
        checks["read_models"] = await _check(_read_models_keep_up, request.app.state.ledger.engine)
    if all(check["ok"] for check in checks.values()):
        return json_response({"status": "ready", "checks": checks})
    return json_response({"status": "not_ready", "checks": checks}, 503, {"retry-after": str(DATABASE_RETRY_AFTER_S)})


async def _check(probe: Callable[[object], dict], target: object) -> dict:
    """`probe(target)` in a thread, bounded: a database that does not answer is a failed check, not a hung request."""
    started = time.perf_counter()
    try:
        found = await asyncio.wait_for(asyncio.to_thread(probe, target), READY_CHECK_TIMEOUT_S)
    except TimeoutError:
        return {"ok": False, "error": f"no answer within {READY_CHECK_TIMEOUT_S} s"}
    except ReadModelsBehind as exc:
        return {"ok": False, "error": str(exc)}
    except Exception as exc:  # what failed is the answer; the details are in the server's log only
        return {"ok": False, "error": type(exc).__name__}
    return {"ok": True, "ms": round((time.perf_counter() - started) * MS_PER_S, 1), **found}


def _database_answers(engine: Engine) -> dict:
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
    return {}


def _redis_answers(url: str) -> dict:
    client = redis.Redis.from_url(url, socket_timeout=READY_CHECK_TIMEOUT_S, socket_connect_timeout=READY_CHECK_TIMEOUT_S)
    try:
        client.ping()
    finally:
        client.close()
    return {}


def _read_models_keep_up(engine: Engine, lag_s_max: float = READY_READ_MODEL_LAG_S_MAX) -> dict:
    """Behind by the age of the oldest event the read models have not applied."""
    lag_s = read_models.lag_seconds(engine)
    if lag_s > lag_s_max:
        raise ReadModelsBehind(f"{lag_s:.0f} s behind")
    return {"lag_s": round(lag_s, 1)}


class ReadModelsBehind(Exception):
    """The read models are further behind the log than READY_READ_MODEL_LAG_S_MAX."""
