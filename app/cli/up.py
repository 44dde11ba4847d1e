"""`paralon up` (what `make run` starts): the whole service on the embedded
default. SQLite, two simulated GPU workers of different profiles owned by a
demo owner, a demo customer with credits, a fresh API key printed with a curl
and an openai example once the proxy accepts connections, then the proxy in
the foreground until Ctrl-C."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import click
import httpx
from sqlalchemy import Engine, select

from app.limits import (
    SIGN_IN_LINK_TTL_MINUTES,
    SIM_WORKERS_START_TIMEOUT_S,
    SIM_WORKERS_STOP_TIMEOUT_S,
    SIM_WORKER_PROBE_INTERVAL_S,
    SIM_WORKER_PROBE_TIMEOUT_S,
)
from app.console.signin import operator_link
from app.http.server import run_server
from app.jobs.celery import celery
from app.members import add_first_member, list_members
from app.migrate import migrate
from app.settings import Settings
from ledger import commands as cmd
from ledger.accounts import create_account
from ledger.db import make_engine
from ledger.money import usd_to_nano_usd
from ledger.schema import accounts
from ledger.service import append_now
from proxy import keys, prices
from proxy import workers as registry
from proxy.schema import workers

DEMO_MODEL = "paralon-demo"
DEMO_CREDITS_USD = "10"
DEMO_CUSTOMER_EMAIL, DEMO_OWNER_EMAIL = "customer@example.com", "owner@example.com"
DEMO_WORKER_PORTS = (("h200", 8101), ("2x4090", 8102))  # (profile, port) of each simulated worker


@dataclass(frozen=True)
class Demo:
    customer_id: int
    owner_id: int
    key: str
    sign_in_links: dict[str, str]  # who -> the path of a fresh console sign-in link; empty when links are mailed


def _account(conn, kind: str, name: str, email: str) -> int:
    found = conn.execute(select(accounts.c.id).where(accounts.c.kind == kind, accounts.c.name == name)).scalar()
    account_id = found if found is not None else create_account(conn, kind, name, email)
    if email not in {m.email for m in list_members(conn, account_id)}:
        add_first_member(conn, account_id, kind, email)
    return account_id


def prepare_demo(engine: Engine, worker_ports: list[tuple[str, int]], print_links: bool = True) -> Demo:
    """Idempotent: a second `make run` reuses the accounts and workers and adds a key."""
    migrate(engine)
    with engine.begin() as conn:
        customer = _account(conn, cmd.CUSTOMER, "Demo customer", DEMO_CUSTOMER_EMAIL)
        owner = _account(conn, cmd.OWNER, "Demo GPU owner", DEMO_OWNER_EMAIL)
        prices.set_price(conn, DEMO_MODEL, "0.15", "0.60")
        for _, port in worker_ports:
            url = f"http://127.0.0.1:{port}"
            if conn.execute(select(workers.c.id).where(workers.c.url == url)).first() is None:
                registry.add_worker(conn, owner, url, DEMO_MODEL)
        _, key = keys.create_key(conn, customer, name="make run")
        links = {who: f"/console/sign-in/{operator_link(conn, email)}"
                 for who, email in (("customer", DEMO_CUSTOMER_EMAIL), ("owner", DEMO_OWNER_EMAIL))} if print_links else {}
    append_now(engine, cmd.GrantCredits(customer, usd_to_nano_usd(DEMO_CREDITS_USD), "demo credits", f"demo:credits:{customer}"))
    return Demo(customer, owner, key, links)


def _require_free(port: int) -> None:
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            raise click.ClickException(f"port {port} is in use: stop what runs there, or set another port")


def start_sim_workers(worker_ports: list[tuple[str, int]]) -> list[subprocess.Popen]:
    """Started and answering, or none left running."""
    processes: list[subprocess.Popen] = []
    try:
        for profile, port in worker_ports:
            _require_free(port)
            processes.append(subprocess.Popen(
                [sys.executable, "-c", "from app.cli import main; main()", "sim-worker", "--port", str(port),
                 "--profile", profile, "--model", DEMO_MODEL]))
        deadline = time.monotonic() + SIM_WORKERS_START_TIMEOUT_S
        for _, port in worker_ports:
            _wait_until_answering(port, deadline)
    except BaseException:
        stop_sim_workers(processes)
        raise
    return processes


def _wait_until_answering(port: int, deadline: float) -> None:
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=SIM_WORKER_PROBE_TIMEOUT_S).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise click.ClickException(f"the simulated worker on port {port} did not start")
        time.sleep(SIM_WORKER_PROBE_INTERVAL_S)


def stop_sim_workers(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(SIM_WORKERS_STOP_TIMEOUT_S)


def print_welcome(demo: Demo, base_url: str, worker_ports: list[tuple[str, int]]) -> None:
    fleet = ", ".join(f"{profile} on :{port}" for profile, port in worker_ports)
    click.echo(f"""
Paralon is running on {base_url} (SQLite at var/, workers: {fleet}).
Demo customer {demo.customer_id} has ${DEMO_CREDITS_USD} of credits; demo owner {demo.owner_id} earns 80% of each request.

API key (shown once): {demo.key}

  curl {base_url}/v1/chat/completions -H "Authorization: Bearer {demo.key}" \\
    -H "Content-Type: application/json" \\
    -d '{{"model": "{DEMO_MODEL}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

  .venv/bin/python -c 'from openai import OpenAI; c = OpenAI(base_url="{base_url}/v1", api_key="{demo.key}"); print(c.chat.completions.create(model="{DEMO_MODEL}", messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=32).usage)'

Balances: .venv/bin/paralon balance {demo.customer_id}   (owner: .venv/bin/paralon balance {demo.owner_id})
{_console_lines(demo, base_url)}
API docs: {base_url}/docs     Stop: Ctrl-C
""")


def _console_lines(demo: Demo, base_url: str) -> str:
    if not demo.sign_in_links:
        return f"Console: {base_url}/console (sign-in links are emailed through PARALON_SMTP_HOST)"
    return "\n".join([f"Console: {base_url}/console; sign in (each link works once, within {SIGN_IN_LINK_TTL_MINUTES} minutes):",
                      *(f"  as the demo {who}: {base_url}{path}" for who, path in demo.sign_in_links.items())])


def run_up(host: str, port: int, worker_ports: tuple[int, int]) -> None:
    settings = Settings.from_env()
    _require_free(port)
    fleet = [(profile, worker_port) for (profile, _), worker_port in zip(DEMO_WORKER_PORTS, worker_ports)]
    demo = prepare_demo(make_engine(settings.database.url), fleet, print_links=not settings.mail.smtp_host)
    processes = start_sim_workers(fleet)
    try:
        run_server(settings, host, port, embedded_beat=celery.conf.task_always_eager,  # no broker: no `paralon beat` either
                   on_listening=lambda: print_welcome(demo, f"http://{host}:{port}", fleet))  # an example run at once works
    finally:
        stop_sim_workers(processes)
