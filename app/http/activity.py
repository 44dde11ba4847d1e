"""An account's activity for management tokens (`GET /v1/activity`): every
request, newest first, with its cost, tokens, time to first token and status,
for a console that follows it live (app/activity.py)."""
from __future__ import annotations

from functools import partial
from typing import Annotated, Literal

from litestar import Controller, Request, Response, get
from litestar.params import QueryParameter

from app import activity
from app.http.errors import SERVICE_EXCEPTION_HANDLERS
from app.http.guards import PRINCIPAL, Caller, requires_reader
from app.http.openapi import MANAGEMENT_TOKEN
from app.http.plumbing import QueryId, json_response, read
from app.limits import ACTIVITY_ROWS_DEFAULT, ACTIVITY_ROWS_MAX
from ledger.limits import INT64_MAX, NAME_CHARS_MAX

CURSOR_CHARS_MAX = len(str(activity.Cursor(INT64_MAX, INT64_MAX)))
Model = Annotated[str | None, QueryParameter(min_length=1, max_length=NAME_CHARS_MAX, description="Only this model's requests")]
KeyId = Annotated[int | None, QueryParameter(ge=1, le=INT64_MAX, description="Only this API key's requests")]
Status = Annotated[Literal[activity.STATUSES] | None, QueryParameter(
    description="streamed, completed (finished, streamed or not), cancelled (cut short: the caller left, its hold ran "
                "out, its worker failed mid-stream; billed for what was relayed) or failed (not charged)")]
After = Annotated[str | None, QueryParameter(pattern=activity.CURSOR_PATTERN, max_length=CURSOR_CHARS_MAX,
                                             description="The `after` of an earlier page: the rows new or changed since")]
Before = Annotated[str | None, QueryParameter(pattern=activity.CURSOR_PATTERN, max_length=CURSOR_CHARS_MAX,
                                              description="The `before` of an earlier page: the rows older than it")]
Limit = Annotated[int, QueryParameter(ge=1, le=ACTIVITY_ROWS_MAX, description="Rows in the page")]


class ActivityController(Controller):
    path = "/v1"
    tags = ["account"]
    security = MANAGEMENT_TOKEN
    dependencies = PRINCIPAL
    exception_handlers = SERVICE_EXCEPTION_HANDLERS

    @get("/activity", guards=[requires_reader],
         summary="Every request of the account, newest first: cost, tokens, time to first token, status")
    async def list_activity(self, request: Request, who: Caller, model: Model = None, key_id: KeyId = None,
                            status: Status = None, after: After = None, before: Before = None,
                            limit: Limit = ACTIVITY_ROWS_DEFAULT, account_id: QueryId = None) -> Response:
        """`data` newest first; `after` is the cursor for what comes next (poll with it), `before` for
        the older page (null: none). A row asked for again with `after` carries its new figures (a reversal)."""
        work = partial(activity.activity, model=model, api_key_id=key_id, status=status, after=after, before=before,
                       limit=limit)
        return json_response(await read(request, work, who, account_id))
