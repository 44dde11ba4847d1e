"""The proxy from the command line: `paralon keys`, `models` (prices),
`workers`, and `sim-worker` (a simulated GPU worker)."""
from __future__ import annotations

import click

from app import worker_traffic
from app.cli.output import emit, engine, handles_errors, json_option
from app.limits import TCP_PORT_MAX
from ledger.money import usd_to_nano_usd
from proxy import keys as api_keys
from proxy import prices as model_prices
from proxy import workers as registry
from proxy.schema import WORKER_TASKS
from proxy.sim.cli import serve as serve_sim

SIM_PROFILES = ("instant", "h200", "rtx-pro-6000", "2x4090", "2x5090")


@click.group("keys")
def keys_group() -> None:
    """API keys for inference (shown once, stored hashed)."""


@keys_group.command("create")
@click.argument("account_id", type=int)
@click.option("--name", default=None)
@click.option("--spend-limit-usd", default=None, help="Refuse requests once the key has spent this much.")
@json_option
@handles_errors
def keys_create(account_id: int, name: str | None, spend_limit_usd: str | None, as_json: bool) -> None:
    limit = usd_to_nano_usd(spend_limit_usd) if spend_limit_usd is not None else None
    with engine().begin() as conn:
        key_id, key = api_keys.create_key(conn, account_id, name=name, spend_limit_nano_usd=limit)
    emit(as_json, {"id": key_id, "key": key, "account_id": account_id, "spend_limit_nano_usd": limit},
         f"key {key_id}: {key}\n(shown once: store it now)")


@keys_group.command("revoke")
@click.argument("key_id", type=int)
@json_option
@handles_errors
def keys_revoke(key_id: int, as_json: bool) -> None:
    with engine().begin() as conn:
        api_keys.revoke_key(conn, key_id)
    emit(as_json, {"id": key_id, "revoked": True}, f"key {key_id} revoked")


@keys_group.command("list")
@click.argument("account_id", type=int)
@json_option
@handles_errors
def keys_list(account_id: int, as_json: bool) -> None:
    with engine().connect() as conn:
        listed = api_keys.list_keys(conn, account_id)
    emit(as_json, {"keys": listed}, "\n".join(f"{k['id']}\t{k['prefix']}…\t{'revoked' if k['revoked'] else 'live'}" for k in listed))


@click.group("models")
def models_group() -> None:
    """Model prices."""


@models_group.command("set-price")
@click.argument("model")
@click.option("--input-usd-per-mtok", required=True, help="USD per million prompt tokens, e.g. 0.15")
@click.option("--output-usd-per-mtok", required=True, help="USD per million completion tokens, e.g. 0.60")
@json_option
@handles_errors
def models_set_price(model: str, input_usd_per_mtok: str, output_usd_per_mtok: str, as_json: bool) -> None:
    with engine().begin() as conn:
        price = model_prices.set_price(conn, model, input_usd_per_mtok, output_usd_per_mtok)
    emit(as_json, {"model": model, **price._asdict()},
         f"{model}: ${input_usd_per_mtok}/MTok in, ${output_usd_per_mtok}/MTok out")


@click.group("workers")
def workers_group() -> None:
    """GPU workers (vLLM or llama.cpp servers) and their owners."""


@workers_group.command("add")
@click.option("--owner", "owner_account_id", type=int, required=True, help="The owner account paid 80% of what it serves.")
@click.option("--url", required=True, help="Base URL of the worker's OpenAI server, e.g. http://10.0.0.5:8000")
@click.option("--model", required=True, help="The public model name callers use.")
@click.option("--engine", "engine_name", type=click.Choice(registry.ENGINES), default="vllm", show_default=True)
@click.option("--context-length", type=int, default=None, help="Tokens; read from the worker when omitted.")
@click.option("--task", type=click.Choice(WORKER_TASKS), default=registry.CHAT, show_default=True,
              help="What it serves: chat (and completions), or embeddings (/v1/embeddings).")
@json_option
@handles_errors
def workers_add(owner_account_id: int, url: str, model: str, engine_name: str, context_length: int | None, task: str,
                as_json: bool) -> None:
    with engine().begin() as conn:
        worker_id = registry.add_worker(conn, owner_account_id, url, model, engine_name, context_length, task)
    emit(as_json, {"id": worker_id, "owner_account_id": owner_account_id, "url": url, "model": model, "engine": engine_name,
                   "task": task}, f"worker {worker_id} added")


@workers_group.command("list")
@json_option
@handles_errors
def workers_list(as_json: bool) -> None:
    """Every worker: state (seconds left of a drain, why suspended), capacity,
    prefix-cache hit rate, share of its model's requests over 24 h."""
    with engine().connect() as conn:
        listed = registry.list_workers(conn)
        rows = worker_traffic.worker_rows(conn, listed)
    emit(as_json, {"workers": rows},
         "\n".join(f"{w.id}\t{_state_text(row)}\t{'healthy' if w.healthy else 'unhealthy'}\t{w.model}{_task_text(w)}\t{w.url}"
                   f"\t{w.usage_strikes} strikes\t{_figures_text(row)}{_suspension_text(w)}" for w, row in zip(listed, rows)))


@workers_group.command("drain")
@click.argument("worker_id", type=int)
@json_option
@handles_errors
def workers_drain(worker_id: int, as_json: bool) -> None:
    """No new requests; in-flight ones finish; `drained` within 120 s."""
    with engine().begin() as conn:
        worker = registry.drain_worker(conn, worker_id)
    emit(as_json, worker.as_dict(), f"worker {worker_id} is {worker.state}")


@workers_group.command("resume")
@click.argument("worker_id", type=int)
@click.option("--reason", default="resumed by an operator", show_default=True, help="Recorded in the WorkerResumed event.")
@json_option
@handles_errors
def workers_resume(worker_id: int, reason: str, as_json: bool) -> None:
    """Return a suspended worker to routing; its strikes start again from zero."""
    with engine().begin() as conn:
        worker = registry.resume_worker(conn, worker_id, resumed_by="operator (command line)", reason=reason)
    emit(as_json, worker.as_dict(), f"worker {worker_id} is {worker.state}")


@click.command("sim-worker")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", required=True, type=click.IntRange(1, TCP_PORT_MAX))
@click.option("--profile", type=click.Choice(SIM_PROFILES), default="instant", show_default=True)
@click.option("--model", default="paralon-demo", show_default=True)
def sim_worker_command(host: str, port: int, profile: str, model: str) -> None:
    """A simulated GPU worker speaking vLLM's OpenAI API."""
    serve_sim(host, port, profile, model)


def _task_text(worker: registry.WorkerView) -> str:
    return " (embeddings)" if worker.task == registry.EMBEDDING else ""


def _state_text(row: dict) -> str:
    if row["drain_seconds_left"] is None:
        return row["state"]
    return f"{row['state']} ({row['drain_seconds_left']} s left)"


def _figures_text(row: dict) -> str:
    capacity = row["throughput_tokens_per_s"]
    measured = f"{'' if row['capacity_saturated'] else 'at least '}{capacity} tok/s"  # below saturation only a floor
    parts = [measured if capacity is not None else "capacity not measured",
             f"{_percent(row['traffic_share_24h'])} of requests (24 h)",
             f"prefix cache {_percent(row['prefix_cache_hit_rate'])}"]
    return ", ".join(parts)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


def _suspension_text(worker: registry.WorkerView) -> str:
    if worker.suspended_at is None:
        return ""
    return f"\tsuspended at {worker.suspended_at.isoformat()}: {worker.suspension_reason}"


COMMANDS = (keys_group, models_group, workers_group, sim_worker_command)
