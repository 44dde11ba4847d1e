"""An account's documents for management tokens: invoices and credit notes
(one by one, or a period's in a zip), monthly statements, ledger exports and
reconciliations, each scoped like the management API (what belongs to another
account answers 404; an admin names any account)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Annotated

from litestar import Controller, Request, Response, get
from litestar.params import FromQuery, QueryParameter
from litestar.response import Stream

from app import accounts
from app.documents_zip import documents_zip
from app.http.errors import SERVICE_EXCEPTION_HANDLERS, NotFound, about_field
from app.http.guards import PRINCIPAL, Caller, requires_any_role, requires_reader
from app.http.openapi import MANAGEMENT_TOKEN
from app.http.plumbing import PathName, QueryId, json_response, path_name, read
from app.limits import HTTP_CATCH_UP_ROUNDS_MAX
from app.statement_labels import statement_labels
from app.tokens import Principal
from invoices import exports, reconciliation, service, statements
from proxy.errors import InvalidRequest

STATEMENT_FORMATS = ("pdf", "json")
# `from` is a Python keyword: the handler parameter names the query parameter.
PeriodFrom = Annotated[str | None, QueryParameter(name="from", description="YYYY-MM or YYYY-MM-DD, UTC, inclusive")]
PeriodTo = Annotated[str | None, QueryParameter(description="YYYY-MM or YYYY-MM-DD, UTC, exclusive")]
RequiredFrom = Annotated[str, QueryParameter(name="from", description="YYYY-MM or YYYY-MM-DD, UTC, inclusive")]
RequiredTo = Annotated[str, QueryParameter(description="YYYY-MM or YYYY-MM-DD, UTC, exclusive")]
MonthFrom = Annotated[str, QueryParameter(name="from", description="YYYY-MM, UTC: the first month")]
MonthTo = Annotated[str, QueryParameter(description="YYYY-MM, UTC: the month after the last")]


class DocumentController(Controller):
    path = "/v1"
    tags = ["documents"]
    security = MANAGEMENT_TOKEN
    dependencies = PRINCIPAL
    exception_handlers = SERVICE_EXCEPTION_HANDLERS

    @get("/invoices", guards=[requires_reader],
         summary="Invoices and credit notes of the account (filter by period and kind)")
    async def list_invoices(self, request: Request, who: Caller, account_id: QueryId = None,
                            kind: FromQuery[str | None] = None, period_from: PeriodFrom = None, to: PeriodTo = None) -> Response:
        """`from` (inclusive) and `to` (exclusive) are YYYY-MM or YYYY-MM-DD, UTC."""
        start, end = period_bound(period_from, "from"), period_bound(to, "to")
        with about_field("kind"):
            listed = await read(request, accounts.list_invoices, accounts.scoped_account(who, account_id), kind, start, end)
        return json_response({"data": listed})

    @get("/invoices.zip", guards=[requires_reader],
         summary="A period's invoices, credit notes and stored statements as PDFs in one zip, with manifest.csv")
    async def invoices_zip(self, request: Request, who: Caller, period_from: RequiredFrom, to: RequiredTo,
                           kind: FromQuery[str | None] = None, account_id: QueryId = None) -> Response:
        """Documents issued in [from, to) (only `kind` when given; statements of the months inside the period
        without one), each only with its recorded SHA-256: any that cannot be had answers 503, never a partial zip."""
        return await documents_zip_response(request, accounts.scoped_account(who, account_id), period_from, to, kind)

    @get("/invoices/{name:str}", guards=[requires_reader],
         summary="One invoice or credit note as PDF (…/PAR-2026-000001.pdf)")
    async def invoice_pdf(self, request: Request, who: Caller, name: PathName) -> Response:
        return await invoice_pdf_response(request, who, name)

    @get("/statements", guards=[requires_any_role], summary="Stored monthly statements of the account (closed months)")
    async def list_statements(self, request: Request, who: Caller, account_id: QueryId = None) -> Response:
        listed = await read(request, statements.list_statements, accounts.scoped_account(who, account_id))
        return json_response({"data": [{k: v for k, v in s.items() if k != "pdf_path"} for s in listed]})  # paths stay inside

    @get("/statements/{name:str}", guards=[requires_any_role],
         summary="The statement of a month: …/2026-11.pdf or …/2026-11.json (provisional while the month is open)")
    async def statement(self, request: Request, who: Caller, name: PathName,
                        account_id: QueryId = None) -> Response:
        return await statement_response(request, accounts.scoped_account(who, account_id), name)

    @get("/exports/ledger.csv", guards=[requires_any_role],
         summary="Every posting of the account in [from, to), with the running balance, as CSV")
    async def ledger_export(self, request: Request, who: Caller, period_from: PeriodFrom = None, to: PeriodTo = None,
                            account_id: QueryId = None) -> Response:
        """`from` (default: the start of this month) and `to` (default: now) are YYYY-MM or YYYY-MM-DD, UTC;
        the opening and closing balances and the row count come in `x-paralon-*` headers."""
        return await ledger_export_response(request, accounts.scoped_account(who, account_id), period_from, to)

    @get("/reconciliation", guards=[requires_any_role],
         summary="Opening balance, top-ups, usage or earnings, refunds, disputes, adjustments and closing balance of whole months")
    async def reconcile(self, request: Request, who: Caller, period_from: MonthFrom, to: MonthTo,
                        account_id: QueryId = None) -> Response:
        """The months [from, to): the figures of the monthly statements and of the ledger export, at one
        read-model position (`through_seq`); `balanced` is false, with the problems named, when they do not add up."""
        return json_response(await reconciliation_figures(request, accounts.scoped_account(who, account_id), period_from, to))


# What a download answers, for the API's routes and the console's alike.

async def invoice_pdf_response(request: Request, who: Principal, name: str) -> Response:
    number = await read(request, accounts.visible_invoice, who, path_name(name, "name").removesuffix(".pdf"))
    # Only the bytes the ledger recorded, else 503 document_unavailable (invoices/files.py).
    content = await asyncio.to_thread(service.invoice_pdf, request.app.state.ledger.engine, request.app.state.invoices, number)
    return Response(content, media_type="application/pdf",
                    headers={"content-disposition": f'attachment; filename="{number}.pdf"'})


async def documents_zip_response(request: Request, account: int, period_from: str, to: str, kind: str | None) -> Response:
    """`account` is one the caller may read (accounts.scoped_account)."""
    start, end = _required_bound(period_from, "from"), _required_bound(to, "to")
    if kind not in (None, *accounts.INVOICE_KINDS):
        raise InvalidRequest(f"kind is {' or '.join(accounts.INVOICE_KINDS)}", param="kind")
    if end <= start:
        raise InvalidRequest("the period is empty: to must be after from", param="to")
    zipped = await asyncio.to_thread(documents_zip, request.app.state.ledger.engine, request.app.state.invoices,
                                     account, kind, start, end)
    return Response(zipped.content, media_type="application/zip", headers={
        "content-disposition": f'attachment; filename="documents-{account}-{start.date()}-{end.date()}.zip"'})


async def reconciliation_figures(request: Request, account: int, period_from: str, to: str) -> dict:
    """`account` is one the caller may read (accounts.scoped_account)."""
    with about_field("from"):
        first = statements.parse_month(period_from)
        reconciliation.require_begun(first)
    with about_field("to"):
        after = statements.parse_month(to)
        reconciliation.require_after(first, after)
    return await asyncio.to_thread(reconciliation.reconcile, request.app.state.ledger.engine, account, first, after,
                                   None, HTTP_CATCH_UP_ROUNDS_MAX)


async def statement_response(request: Request, account: int, name: str) -> Response:
    """`account` is one the caller may read (accounts.scoped_account)."""
    month_text, _, fmt = path_name(name, "name").rpartition(".")
    if fmt not in STATEMENT_FORMATS:
        raise NotFound(f"no statement {name}: ask for YYYY-MM.pdf or YYYY-MM.json")
    engine, settings = request.app.state.ledger.engine, request.app.state.invoices

    def work() -> tuple[object, bool]:
        month = statements.parse_month(month_text)
        if fmt == "json":
            return statements.figures(engine, settings, account, month, statement_labels,
                                      rounds_max=HTTP_CATCH_UP_ROUNDS_MAX), False
        return statements.document(engine, settings, account, month, statement_labels, rounds_max=HTTP_CATCH_UP_ROUNDS_MAX)

    content, provisional = await asyncio.to_thread(work)
    if fmt == "json":
        return json_response(content)
    filename = f"statement-{account}-{month_text}{'-provisional' if provisional else ''}.pdf"
    return Response(content, media_type="application/pdf",
                    headers={"content-disposition": f'attachment; filename="{filename}"'})


async def ledger_export_response(request: Request, account: int, period_from: str | None, to: str | None) -> Response:
    """`account` is one the caller may read (accounts.scoped_account)."""
    now = datetime.now(UTC)
    start = period_bound(period_from, "from") or now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = min(period_bound(to, "to") or now, now)  # what has not happened yet cannot be exported
    if end <= start:
        raise InvalidRequest("the period is empty: to must be after from, and from before now", param="to")
    engine = request.app.state.ledger.engine
    totals = await asyncio.to_thread(exports.prepare, engine, account, start, end, HTTP_CATCH_UP_ROUNDS_MAX)
    chunks = exports.csv_chunks(engine, account, start, end, totals)
    # Litestar appends "; charset=utf-8" to a text/ type itself: naming it here sent it twice.
    return Stream(iterate_in_threads(chunks), media_type="text/csv", headers={
        "content-disposition": f'attachment; filename="ledger-{account}-{start.date()}-{end.date()}.csv"',
        "x-paralon-opening-balance-nano-usd": str(totals.opening_balance_nano_usd),
        "x-paralon-closing-balance-nano-usd": str(totals.closing_balance_nano_usd),
        "x-paralon-postings": str(totals.postings), "x-paralon-through-seq": str(totals.through_seq)})

def period_bound(value: str | None, name: str) -> datetime | None:
    """'2026-11' or '2026-11-29' -> the UTC datetime it starts at; None when absent."""
    if not value:
        return None
    with about_field(name):
        return exports.parse_period_bound(value, name)


def _required_bound(value: str, name: str) -> datetime:
    bound = period_bound(value, name)
    if bound is None:
        raise InvalidRequest(f"{name} is required: YYYY-MM or YYYY-MM-DD", param=name)
    return bound


async def iterate_in_threads(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """An iterator whose every step reads the database, stepped off the event loop."""
    done = object()
    while (chunk := await asyncio.to_thread(next, chunks, done)) is not done:
        yield chunk
