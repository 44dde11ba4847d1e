"""The management API: accounts, API keys and workers, for management tokens.

Every endpoint takes `Authorization: Bearer pt-par-…`. A token acts for its
own account only; what belongs to another account answers 404, exactly as
what does not exist, so a token learns nothing about accounts it may not see.
Controllers translate HTTP to the same functions the CLI calls."""
from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path

import orjson
from litestar import Request, Response, delete, get, post
from litestar.response import Stream
from sqlalchemy import func, select

from app.tokens import Principal, find_token
from invoices import exports, statements
from invoices.schema import earnings_daily, usage_daily
from invoices.schema import invoices as invoices_table
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.errors import InvariantBroken, LedgerError
from ledger.money import usd_to_nano_usd
from proxy import keys as api_keys
from proxy import workers as registry
from proxy.errors import AuthenticationFailed, InvalidRequest, NotFound, NotReady, PermissionDenied, ProxyError

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
    body = await _json_object(request)
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
    request.app.state.directory.evict_key(key_id)  # this process at once; other replicas hear of it from the database
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


class WorkerNotSuspended(ProxyError):
    status, error_type, code = 409, "invalid_request_error", "worker_not_suspended"


@post("/v1/workers/{worker_id:int}/resume", summary="Resume a suspended worker (admins): its strikes start again from zero",
      status_code=200)
async def resume_worker(request: Request, worker_id: int) -> Response:
    """Body (optional): {"reason": "…"}. A draining or drained worker is not resumed (409)."""
    who = await principal(request, ("admin",))  # an owner may not lift its own worker's suspension
    body = await _json_object(request)
    reason = body.get("reason", "resumed by an administrator")

    def work(conn):
        try:
            return registry.resume_worker(conn, worker_id, resumed_by=f"admin token {who.token_id}", reason=reason).as_dict()
        except registry.UnknownWorker:
            raise NotFound(f"no worker {worker_id}") from None
        except registry.WorkerNotSuspended as exc:
            raise WorkerNotSuspended(str(exc)) from None

    return _json(await _db(request, work, write=True))


async def _json_object(request: Request) -> dict:
    try:
        body = orjson.loads(await request.body() or b"{}")
    except orjson.JSONDecodeError:
        raise InvalidRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


MANAGEMENT_HANDLERS = [get_account, list_keys, create_key, revoke_key, list_workers, drain_worker, resume_worker]


@post("/v1/credits/checkout", summary="Start a card top-up: a Stripe Checkout session for the caller's account",
      status_code=201)
async def create_checkout(request: Request) -> Response:
    from app.payments.stripe import create_checkout as start_checkout

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
    from app.payments.crypto import connect, deposit_address

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


INVOICE_ROLES = ("customer", "accountant", "admin")


def _period(value: str | None, name: str):
    """'2026-11' or '2026-11-29' -> the UTC datetime it starts at; None when absent."""
    if not value:
        return None
    try:
        return exports.parse_period_bound(value, name)
    except LedgerError as exc:
        raise InvalidRequest(str(exc), param=name) from None


@get("/v1/invoices", summary="Invoices and credit notes of the account (filter by period and kind)")
async def list_invoice_documents(request: Request, account_id: int | None = None, kind: str | None = None,
                                 to: str | None = None) -> Response:
    """`from` (inclusive) and `to` (exclusive) are YYYY-MM or YYYY-MM-DD, UTC."""
    who = await principal(request, INVOICE_ROLES)
    account = _scoped_account(who, account_id)
    if kind not in (None, "invoice", "credit_note"):
        raise InvalidRequest("kind is invoice or credit_note", param="kind")
    start, end = _period(request.query_params.get("from"), "from"), _period(to, "to")

    def work(conn):
        query = select(invoices_table).where(invoices_table.c.account_id == account).order_by(invoices_table.c.issued_at)
        if kind:
            query = query.where(invoices_table.c.kind == kind)
        if start:
            query = query.where(invoices_table.c.issued_at >= start)
        if end:
            query = query.where(invoices_table.c.issued_at < end)
        return [{"number": r.number, "kind": r.kind, "amount_nano_usd": r.amount_nano_usd, "issued_at": r.issued_at.isoformat(),
                 "corrects": r.corrects_number, "payment_method": r.payment_method,
                 "pdf_sha256": r.pdf_sha256.hex() if r.pdf_sha256 else None} for r in conn.execute(query)]

    return _json({"data": await _db(request, work)})


@get("/v1/invoices/{name:str}", summary="One invoice or credit note as PDF (…/PAR-2026-000001.pdf)")
async def invoice_pdf(request: Request, name: str) -> Response:
    who = await principal(request, INVOICE_ROLES)
    number = name.removesuffix(".pdf")

    def work(conn):
        return conn.execute(select(invoices_table.c.account_id, invoices_table.c.pdf_path).where(invoices_table.c.number == number)).first()

    row = await _db(request, work)
    if row is None or row.pdf_path is None or (row.account_id != who.account_id and not who.is_admin):
        raise NotFound(f"no invoice {number}")
    content = await asyncio.to_thread(Path(row.pdf_path).read_bytes)
    return Response(content, media_type="application/pdf", headers={"content-disposition": f'attachment; filename="{number}.pdf"'})


USAGE_GROUPS = {"day": "day", "model": "model", "key": "api_key_id"}
EARNINGS_GROUPS = {"day": "day", "worker": "worker_id", "model": "model"}


@get("/v1/usage", summary="Usage of the account from the read models, grouped by day, model or key")
async def usage(request: Request, group_by: str = "day", account_id: int | None = None) -> Response:
    who = await principal(request, INVOICE_ROLES)
    account = _scoped_account(who, account_id)
    if group_by not in USAGE_GROUPS:
        raise InvalidRequest(f"group_by is one of {', '.join(USAGE_GROUPS)}", param="group_by")
    column = usage_daily.c[USAGE_GROUPS[group_by]]

    def work(conn):
        sums = [func.sum(usage_daily.c[name]).label(name) for name in ("requests", "prompt_tokens", "completion_tokens", "cost_nano_usd")]
        rows = conn.execute(select(column.label("group"), *sums).where(usage_daily.c.account_id == account)
                            .group_by(column).order_by(column))
        return [{group_by: r.group, **{k: int(getattr(r, k)) for k in ("requests", "prompt_tokens", "completion_tokens", "cost_nano_usd")}}
                for r in rows]

    return _json({"data": await _db(request, work)})


@get("/v1/earnings", summary="Earnings of the owner from the read models, grouped by day, worker or model")
async def earnings(request: Request, group_by: str = "day", account_id: int | None = None) -> Response:
    who = await principal(request, ("owner", "admin"))
    owner = _scoped_account(who, account_id)
    if group_by not in EARNINGS_GROUPS:
        raise InvalidRequest(f"group_by is one of {', '.join(EARNINGS_GROUPS)}", param="group_by")
    column = earnings_daily.c[EARNINGS_GROUPS[group_by]]

    def work(conn):
        rows = conn.execute(select(column.label("group"), func.sum(earnings_daily.c.requests).label("requests"),
                                   func.sum(earnings_daily.c.earnings_nano_usd).label("earnings_nano_usd"))
                            .where(earnings_daily.c.owner_account_id == owner).group_by(column).order_by(column))
        return [{group_by: r.group, "requests": int(r.requests), "earnings_nano_usd": int(r.earnings_nano_usd)} for r in rows]

    return _json({"data": await _db(request, work)})


MANAGEMENT_HANDLERS.extend([list_invoice_documents, invoice_pdf, usage, earnings])


DOCUMENT_ROLES = ("customer", "accountant", "owner", "admin")
STATEMENT_FORMATS = ("pdf", "json")


def _invoice_settings(request: Request):
    from app.settings import Settings

    return request.app.state.invoices or Settings.from_env().invoices()


@get("/v1/statements", summary="Stored monthly statements of the account (closed months)")
async def list_statement_documents(request: Request, account_id: int | None = None) -> Response:
    who = await principal(request, DOCUMENT_ROLES)
    account = _scoped_account(who, account_id)
    listed = await _db(request, lambda conn: statements.list_statements(conn, account))
    return _json({"data": [{k: v for k, v in s.items() if k != "pdf_path"} for s in listed]})  # server paths stay inside


@get("/v1/statements/{name:str}", summary="The statement of a month: …/2026-11.pdf or …/2026-11.json (provisional while the month is open)")
async def statement(request: Request, name: str, account_id: int | None = None) -> Response:
    from app.statement_labels import statement_labels

    who = await principal(request, DOCUMENT_ROLES)
    account = _scoped_account(who, account_id)
    month_text, _, fmt = name.rpartition(".")
    if fmt not in STATEMENT_FORMATS:
        raise NotFound(f"no statement {name}: ask for YYYY-MM.pdf or YYYY-MM.json")
    engine, settings = request.app.state.ledger.engine, _invoice_settings(request)

    def work():
        month = statements.parse_month(month_text)
        if fmt == "json":
            return statements.figures(engine, settings, account, month, statement_labels, rounds_max=1), None
        return statements.document(engine, settings, account, month, statement_labels, rounds_max=1)

    try:
        content, provisional = await asyncio.to_thread(work)
    except statements.StatementNotReady as exc:
        raise NotReady(str(exc)) from None
    except statements.NoStatement as exc:
        raise NotFound(str(exc)) from None
    except InvariantBroken as exc:  # the books disagree: not the caller's doing
        raise ProxyError(str(exc)) from None
    except LedgerError as exc:
        raise InvalidRequest(str(exc)) from None
    if fmt == "json":
        return _json(content)
    filename = f"statement-{account}-{month_text}{'-provisional' if provisional else ''}.pdf"
    return Response(content, media_type="application/pdf", headers={"content-disposition": f'attachment; filename="{filename}"'})


@get("/v1/exports/ledger.csv", summary="Every posting of the account in [from, to), with the running balance, as CSV")
async def ledger_export(request: Request, to: str | None = None, account_id: int | None = None) -> Response:
    """`from` (default: the start of this month) and `to` (default: now) are YYYY-MM or YYYY-MM-DD, UTC;
    the opening and closing balances and the row count come in `x-paralon-*` headers."""
    who = await principal(request, DOCUMENT_ROLES)
    account = _scoped_account(who, account_id)
    now = datetime.now(UTC)
    start = _period(request.query_params.get("from"), "from") or now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = min(_period(to, "to") or now, now)  # what has not happened yet cannot be exported
    if end <= start:
        raise InvalidRequest("the period is empty: to must be after from, and from before now", param="to")
    engine = request.app.state.ledger.engine

    try:
        totals = await asyncio.to_thread(exports.prepare, engine, account, start, end, 1)
    except statements.StatementNotReady as exc:
        raise NotReady(str(exc)) from None
    chunks = exports.csv_chunks(engine, account, start, end, totals)
    name = f"ledger-{account}-{start.date()}-{end.date()}.csv"
    return Stream(iterate_in_threads(chunks), media_type="text/csv; charset=utf-8", headers={
        "content-disposition": f'attachment; filename="{name}"',
        "x-paralon-opening-balance-nano-usd": str(totals.opening_balance_nano_usd),
        "x-paralon-closing-balance-nano-usd": str(totals.closing_balance_nano_usd),
        "x-paralon-postings": str(totals.postings), "x-paralon-through-seq": str(totals.through_seq)})


async def iterate_in_threads(chunks):
    """An iterator whose every step reads the database, stepped off the event loop."""
    done = object()
    while (chunk := await asyncio.to_thread(next, chunks, done)) is not done:
        yield chunk


MANAGEMENT_HANDLERS.extend([list_statement_documents, statement, ledger_export])
