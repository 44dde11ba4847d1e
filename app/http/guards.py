"""Who may call what. A guard authenticates the request's bearer token before
the handler runs (and before its body is read) and keeps who it is on the
request's state; handlers receive it as `grant` (an API key, for inference)
or `who` (a management token: app/tokens.py says what each role is for)."""
from __future__ import annotations

import asyncio

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency, Provide
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Guard
from sqlalchemy import Engine

from app.http.errors import AuthenticationFailed, PermissionDenied
from app.tokens import ACCOUNTANT, ADMIN, CUSTOMER, OWNER, ROLES, VIEWER, Principal, find_token
from ledger.errors import a_or_an
from proxy.directory import Directory
from proxy.keys import KeyGrant


def bearer_token(authorization: str, missing: str) -> str:
    """The token of an `Authorization: Bearer …` header's value."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed(missing)
    return token.strip()


async def api_key_grant(directory: Directory, authorization: str) -> KeyGrant:
    """What the live API key (`sk-par-…`) of an Authorization header may spend; management tokens are refused."""
    grant = await directory.authenticate(bearer_token(authorization, "missing API key: send Authorization: Bearer sk-…"))
    if grant is None:
        raise AuthenticationFailed("invalid or revoked API key")
    return grant


async def requires_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    connection.state.grant = await api_key_grant(connection.app.state.directory, connection.headers.get("authorization", ""))


def requires_role(*roles: str) -> Guard:
    """A live management token (`pt-par-…`) of one of these roles; API keys are refused."""
    if not roles or not set(roles) <= set(ROLES):
        raise ValueError(f"roles are among {', '.join(ROLES)}, got {roles!r}")

    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        who = await _management_principal(connection)
        if who.role not in roles:
            raise PermissionDenied(f"{a_or_an(who.role)} token may not do this")

    guard.__qualname__ = guard.__name__ = f"requires_role({', '.join(roles)})"
    guard.roles = frozenset(roles)  # the console's pages share a route's roles (app/console/web.py)
    return guard


async def _management_principal(connection: ASGIConnection) -> Principal:
    token = bearer_token(connection.headers.get("authorization", ""),
                         "missing management token: send Authorization: Bearer pt-par-…")
    found = await asyncio.to_thread(_find_token, connection.app.state.ledger.engine, token)
    if found is None:
        raise AuthenticationFailed("invalid or revoked management token (API keys are for inference only)")
    connection.state.principal = found
    return found


def _find_token(engine: Engine, token: str) -> Principal | None:
    with engine.connect() as conn:
        return find_token(conn, token)


# Who may call what; each route names one of these.
requires_any_role = requires_role(*ROLES)
requires_reader = requires_role(CUSTOMER, VIEWER, ACCOUNTANT, ADMIN)  # a customer account's keys, invoices and usage
requires_customer = requires_role(CUSTOMER)  # new API keys and top-ups
requires_customer_or_admin = requires_role(CUSTOMER, ADMIN)  # revoking an API key
requires_owner_or_admin = requires_role(OWNER, ADMIN)  # workers and earnings
requires_owner = requires_role(OWNER)  # payouts and where they go: only the owner moves its own money
requires_admin = requires_role(ADMIN)  # lifting a worker's suspension: never its own owner


def _grant(request: Request) -> KeyGrant:
    return request.state.grant


def _principal(request: Request) -> Principal:
    return request.state.principal


# What the guards found, as handler parameters: `grant: KeyHolder` behind requires_api_key,
# `who: Caller` behind requires_role.
GRANT = {"grant": Provide(_grant, sync_to_thread=False)}
PRINCIPAL = {"who": Provide(_principal, sync_to_thread=False)}
KeyHolder = NamedDependency[KeyGrant]
Caller = NamedDependency[Principal]
