"""The management API: accounts, API keys and workers, for management tokens.

Every endpoint takes `Authorization: Bearer pt-par-…`. A token acts for its
own account only; what belongs to another account answers 404, exactly as
what does not exist, so a token learns nothing about accounts it may not see.
Controllers translate HTTP to the same functions the CLI calls."""
from __future__ import annotations

import asyncio
import time

import orjson
from litestar import Request, Response, delete, get, post

from app.tokens import Principal, find_token
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.errors import LedgerError
from ledger.money import usd_to_nano_usd
from proxy import keys as api_keys
from proxy import workers as registry
from proxy.errors import AuthenticationFailed, InvalidRequest, NotFound, PermissionDenied

KEY_ROLES_READ = ("customer", "accountant", "admin")
WORKER_ROLES = ("owner", "admin")


def _json(data: dict, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


async def principal(request: Request, roles: tuple[str, ...]) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed("missing management token: send Authorization: Bearer pt-par-…")
    engine = request.app.state.ledger.engine

    def lookup():
        with engine.connect() as conn:
            return find_token(conn, token.strip())

    found = await asyncio.to_thread(lookup)
    if found is None:
        raise AuthenticationFailed("invalid or revoked management token (API keys are for inference only)")
    if found.role not in roles:
        raise PermissionDenied(f"a {found.role} token may not do this")
    return found


async def _db(request: Request, work, *, write: bool = False):
    engine = request.app.state.ledger.engine

    def run():
        with (engine.begin() if write else engine.connect()) as conn:
            return work(conn)

    try:
        return await asyncio.to_thread(run)
    except LedgerError as exc:
        raise InvalidRequest(str(exc)) from None


def _account_view(conn, account_id: int, role: str) -> dict:
    view = acc.read_balance(conn, account_id)
    data = {"id": account_id, "kind": view.kind, "role": role, "balance_nano_usd": view.balance_nano_usd,
            "available_nano_usd": view.available_nano_usd, "held_nano_usd": view.held_nano_usd}
    if view.kind == cmd.OWNER:
        data["earnings_nano_usd"] = view.balance_nano_usd
    return data


@get("/v1/account", summary="The token's own account and its balances")
async def get_account(request: Request) -> Response:
    who = await principal(request, ("customer", "accountant", "owner", "admin"))
    return _json(await _db(request, lambda conn: _account_view(conn, who.account_id, who.role)))


def _scoped_account(who: Principal, account_id: int | None) -> int:
    """Admins name any account; everyone else gets their own."""
    return account_id if who.is_admin and account_id is not None else who.account_id


@get("/v1/keys", summary="API keys of the account")
async def list_keys(request: Request, account_id: int | None = None) -> Response:
    who = await principal(request, KEY_ROLES_READ)
    account = _scoped_account(who, account_id)
    return _json({"data": await _db(request, lambda conn: api_keys.list_keys(conn, account))})


@post("/v1/keys", summary="Create an API key (shown once)", status_code=201)
async def create_key(request: Request) -> Response:
    who = await principal(request, ("customer",))
    try:
        body = orjson.loads(await request.body() or b"{}")
    except orjson.JSONDecodeError:
        raise InvalidRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    limit_text = body.get("spend_limit_usd")
    try:
        limit = usd_to_nano_usd(str(limit_text)) if limit_text is not None else None
    except LedgerError as exc:
        raise InvalidRequest(str(exc), param="spend_limit_usd") from None
    key_id, key = await _db(request, lambda conn: api_keys.create_key(conn, who.account_id, name=body.get("name"),
                                                                     spend_limit_nano_usd=limit), write=True)
    return _json({"id": key_id, "key": key, "spend_limit_nano_usd": limit}, 201)


@delete("/v1/keys/{key_id:int}", summary="Revoke an API key", status_code=200)
async def revoke_key(request: Request, key_id: int) -> Response:
    who = await principal(request, ("customer", "admin"))

    def work(conn):
        owner = api_keys.key_account(conn, key_id)
        if owner is None or (owner != who.account_id and not who.is_admin):
            raise NotFound(f"no API key {key_id}")
        api_keys.revoke_key(conn, key_id)

    await _db(request, work, write=True)
    return _json({"id": key_id, "revoked": True})


@get("/v1/workers", summary="Workers of the owner (all of them for an admin)")
async def list_workers(request: Request) -> Response:
    who = await principal(request, WORKER_ROLES)
    owner = None if who.is_admin else who.account_id
    listed = await _db(request, lambda conn: registry.list_workers(conn, owner_account_id=owner))
    return _json({"data": [w.as_dict() for w in listed]})


@post("/v1/workers/{worker_id:int}/drain", summary="Drain a worker: no new requests, in-flight ones finish", status_code=200)
async def drain_worker(request: Request, worker_id: int) -> Response:
    who = await principal(request, WORKER_ROLES)

    def work(conn):
        visible = registry.list_workers(conn, owner_account_id=None if who.is_admin else who.account_id)
        if worker_id not in {w.id for w in visible}:
            raise NotFound(f"no worker {worker_id}")
        return registry.drain_worker(conn, worker_id).as_dict()

    return _json(await _db(request, work, write=True))


MANAGEMENT_HANDLERS = [get_account, list_keys, create_key, revoke_key, list_workers, drain_worker]


@post("/v1/credits/checkout", summary="Start a card top-up: a Stripe Checkout session for the caller's account",
      status_code=201)
async def create_checkout(request: Request) -> Response:
    from app.stripe_payments import create_checkout as start_checkout

    who = await principal(request, ("customer",))
    try:
        body = orjson.loads(await request.body() or b"{}")
    except orjson.JSONDecodeError:
        raise InvalidRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict) or "amount_usd" not in body:
        raise InvalidRequest('send {"amount_usd": "25.00"}', param="amount_usd")
    caller_key = request.headers.get("idempotency-key") or f"{who.token_id}:{int(time.time()) // 60}"
    settings, engine = request.app.state.stripe, request.app.state.ledger.engine
    try:
        session = await asyncio.to_thread(start_checkout, engine, settings, who.account_id, body["amount_usd"], caller_key)
    except LedgerError as exc:
        raise InvalidRequest(str(exc), param="amount_usd") from None
    return _json(session, 201)


MANAGEMENT_HANDLERS.append(create_checkout)


@get("/v1/credits/crypto/address", summary="The caller's own stablecoin deposit address")
async def crypto_address(request: Request) -> Response:
    from app.crypto_deposits import connect, deposit_address

    who = await principal(request, ("customer",))
    settings = request.app.state.crypto

    def work():
        address = deposit_address(request.app.state.ledger.engine, settings, who.account_id)
        return {"address": address, "chain_id": connect(settings).eth.chain_id if settings.rpc_url else None}

    try:
        return _json(await asyncio.to_thread(work))
    except LedgerError as exc:
        raise InvalidRequest(str(exc)) from None


MANAGEMENT_HANDLERS.append(crypto_address)
