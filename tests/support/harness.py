"""Real servers for proxy tests: simulated workers (uvicorn in a thread of the
test process, so their counters can be read) and `paralon serve` processes."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from sqlalchemy import select

from app.migrate import migrate
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.db import make_engine, snapshot_connection
from ledger.money import usd_to_nano_usd
from ledger.schema import holds, ledger_events
from ledger.service import append_now
from proxy import keys, prices
from proxy import workers as registry
from proxy.limits import DIRECTORY_REFRESH_INTERVAL_S, HOLD_POOL_IDLE_S
from proxy.sim.worker import build_app
from tests.support.db_roles import app_role_url
from tests.support.serve_forks import ForkedProcess, fork_serve

MODEL = "paralon-test"
START_TIMEOUT_S = 90.0  # importing the service takes 30 s on a loaded 2-core machine
STOP_WAIT_S = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(RuntimeError):
    """A port chosen free was bound by another process (another test's server) before ours."""


# A process starting on a port chosen free tries again on another this many times.
PORT_ATTEMPTS = 3
_TCP_LISTEN = "0A"  # the LISTEN state in /proc/net/tcp


def _listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on `port` (Linux /proc/net/tcp)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == _TCP_LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def _listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` holds the socket listening on `port`: a /health that
    answers may be another test's server that took the port first."""
    inodes = _listening_inodes(port)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[len("socket:["):-1] in inodes:
            return True
    return False


class ThreadedServer:
    """An ASGI app on uvicorn in a background thread."""

    def __init__(self, app, port: int | None = None, http: str | type = "auto") -> None:
        self.app = app
        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False, lifespan="off", http=http))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ThreadedServer":
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the simulated worker did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def sim_worker(profile: str = "instant", model: str = MODEL, **options) -> ThreadedServer:
    return ThreadedServer(build_app(profile, model, **options)).start()


class SimWorkerProcess:
    """A simulated worker in a process of its own (`paralon sim-worker`): where
    a test's load would starve one sharing the test process's interpreter, and
    so slow its health checks past their timeout."""

    def __init__(self, profile: str = "instant", model: str = MODEL, port: int | None = None) -> None:
        self.port, self.port_given = port or free_port(), port is not None
        self.profile, self.model = profile, model
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "SimWorkerProcess":
        return start_on_a_free_port(self, lambda: subprocess.Popen(self._argv(), start_new_session=True, stdout=subprocess.DEVNULL),
                                    "the simulated worker")

    def _argv(self) -> list[str]:
        return [sys.executable, "-c", "from app.cli import main; main()", "sim-worker", "--port", str(self.port),
                "--profile", self.profile, "--model", self.model]

    def stop(self) -> None:
        stop_process(self.process)


class ServeProcess:
    """`paralon serve` as operators run it (its own process, environment and
    process group; forked with the libraries already imported), on its own
    port: on PostgreSQL as a role that owns nothing (tests/support/db_roles.py)."""

    def __init__(self, database_url: str, port: int | None = None, **env: str) -> None:
        self.port, self.port_given = port or free_port(), port is not None
        self.env = {**os.environ, "PARALON_DATABASE_URL": app_role_url(database_url), "PARALON_HEALTH_INTERVAL_MS": "200",
                    "PARALON_KEY_CACHE_TTL_MS": "0", "PARALON_GROUP_COMMIT_WAIT_MS": "1", **env}
        self.process: ForkedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServeProcess":
        # Forked with the libraries imported (tests/support/serve_forks.py), in a process
        # group of its own, so that a test can kill it whole (tests/support/faults.py).
        return start_on_a_free_port(self, lambda: fork_serve(["serve", "--port", str(self.port)], self.env), "paralon serve")

    def stop(self) -> None:
        stop_process(self.process)


def start_on_a_free_port(server, launch, what: str):
    """Launch and wait for health; on a port chosen free that another process
    bound first, again on another (a port given by the test is kept). A
    server has port, port_given, process, url and stop(), and answers /health."""
    for _ in range(PORT_ATTEMPTS):
        server.process = launch()
        try:
            _await_health(server, what)
            return server
        except PortTaken:
            if server.port_given:
                raise
            server.port = free_port()
    raise PortTaken(f"{what}: every port tried was taken before it could bind it")


def _await_health(server: SimWorkerProcess | ServeProcess, what: str) -> None:
    """Until its /health answers 200 from its own socket; stopped, and an error
    naming it, if it exits or takes too long."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if server.process.poll() is not None:
            if _listening_inodes(server.port):
                raise PortTaken(f"{what} exited: port {server.port} was taken by another process")
            said = server.process.stdout.read() if server.process.stdout else ""
            raise RuntimeError(f"{what} exited: {said}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200 and _listens_on(server.process.pid, server.port):
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"{what} did not answer in time")
        time.sleep(0.05)


def stop_process(process: subprocess.Popen | ForkedProcess | None) -> None:
    """SIGTERM, and SIGKILL if it has not exited within STOP_WAIT_S; reaped either way."""
    if process and process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Fleet:
    database_url: str
    engine: object
    customer_id: int
    owner_ids: list[int]
    worker_ids: list[int]
    key: str
    key_id: int

    def balance(self, account_id: int) -> acc.BalanceView:
        with self.engine.connect() as conn:
            return acc.read_balance(conn, account_id)

    def pools_released(self) -> None:
        """Wait until no replica's pooled hold is left: a pool (PARALON_HOLD_POOLS,
        the default) holds what its requests did not use until HOLD_POOL_IDLE_S
        after its last one, so a customer's held sum is 0 only then."""
        def none_left() -> bool:
            with self.engine.connect() as conn:
                return not conn.execute(select(holds.c.id).where(holds.c.idempotency_key.like("pool:%")).limit(1)).first()

        wait_for(none_left, timeout_s=HOLD_POOL_IDLE_S + 10)

    def settlements(self) -> list[dict]:
        import orjson

        with self.engine.connect() as conn:
            rows = conn.execute(select(ledger_events.c.payload).where(ledger_events.c.event_type == "RequestSettled"))
            return [orjson.loads(r.payload) for r in rows]

    def events(self, event_type: str) -> int:
        with self.engine.connect() as conn:
            return len(conn.execute(select(ledger_events.c.seq).where(ledger_events.c.event_type == event_type)).all())

    def assert_books_close(self) -> None:
        """Owner earnings are the sum of charge*80//100; the chain and balances verify."""
        from ledger.verify import verify

        owners_total = sum(self.balance(o).balance_nano_usd for o in self.owner_ids)
        assert owners_total == sum(s["charge_nano_usd"] * 80 // 100 for s in self.settlements())
        with snapshot_connection(self.engine) as conn:  # the proxy may still be appending
            assert verify(conn).ok

    def worker(self, worker_id: int) -> registry.WorkerView:
        with self.engine.connect() as conn:
            return registry.get_worker(conn, worker_id)

    def await_routable(self, timeout_s: float = 30.0, also: tuple[int, ...] = ()) -> None:
        """Until a health check has found every worker (and those of `also`)
        healthy (a worker starts unhealthy, and a first check that times out on a
        loaded machine leaves it so until the next), and every replica's
        directory has read that."""
        wait_for(lambda: all(self.worker(w).healthy for w in (*self.worker_ids, *also)), timeout_s=timeout_s)
        time.sleep(2 * DIRECTORY_REFRESH_INTERVAL_S)


def make_fleet(database_url: str, worker_urls: list[str], *, credits_usd: str = "10", input_usd_per_mtok: str = "0.15",
               output_usd_per_mtok: str = "0.60", engines: list[str] | None = None, spend_limit_usd: str | None = None,
               context_lengths: list[int | None] | None = None) -> Fleet:
    """A customer with credits and a key, one owner per worker, the model priced."""
    engine = make_engine(database_url)
    migrate(engine)
    with engine.begin() as conn:
        customer = acc.create_account(conn, cmd.CUSTOMER, "test customer", "customer@example.com")
        owners = [acc.create_account(conn, cmd.OWNER, f"owner {i}") for i in range(len(worker_urls))]
        engines = engines or ["vllm"] * len(worker_urls)
        context_lengths = context_lengths or [None] * len(worker_urls)
        worker_ids = [registry.add_worker(conn, owner, url, MODEL, engines[i], context_lengths[i])
                      for i, (owner, url) in enumerate(zip(owners, worker_urls))]
        prices.set_price(conn, MODEL, input_usd_per_mtok, output_usd_per_mtok)
        limit = usd_to_nano_usd(spend_limit_usd) if spend_limit_usd else None
        key_id, key = keys.create_key(conn, customer, spend_limit_nano_usd=limit)
    if credits_usd != "0":
        append_now(engine, cmd.GrantCredits(customer, usd_to_nano_usd(credits_usd), "test credits", f"grant:{customer}"))
    return Fleet(database_url, engine, customer, owners, worker_ids, key, key_id)


@contextmanager
def serving(database_url: str, **env: str):
    proc = ServeProcess(database_url, **env).start()
    try:
        yield proc
    except BaseException:
        print_log_tail(proc)
        raise
    finally:
        proc.stop()


SERVE_LOG_TAIL_LINES = 40


def print_log_tail(proc: ServeProcess) -> None:
    """The end of a replica's log on stderr, which pytest shows with a failure:
    what the replica said about it (a 503's cause, a batch that failed)."""
    if proc.process is not None and proc.process.stdout is not None:
        lines = proc.process.stdout.read().splitlines()[-SERVE_LOG_TAIL_LINES:]
        print(f"--- the last lines of paralon serve on port {proc.port} ---", *lines, sep="\n", file=sys.stderr)


@contextmanager
def watched(read, interval_s: float = 0.0):
    """`read()` called again and again in a thread while the block runs,
    `interval_s` apart: yields the list of its readings."""
    stop, readings = threading.Event(), []

    def watch() -> None:
        while not stop.is_set():
            readings.append(read())
            stop.wait(interval_s)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield readings
    finally:
        stop.set()
        watcher.join()


def lowest_available_watched(fleet: "Fleet"):
    """The customer's available balance watched while the block runs (its minimum is what matters)."""
    return watched(lambda: fleet.balance(fleet.customer_id).available_nano_usd)


def wait_for(predicate, timeout_s: float = 15.0, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError("condition not reached in time")
