"""A local stand-in for the part of Stripe's API that Paralon calls: creating
Checkout Sessions (form-encoded, honouring Idempotency-Key) and retrieving
them; creating Transfers to connected accounts, retrieving them and listing
them by transfer group. The real `stripe` SDK runs end to end offline. It
records every request it got. A session is unpaid until the test pays it
(`pay`), as on Stripe until the customer pays; a transfer is reversed when the
test reverses it (`reverse`).

Transfers keep Idempotency-Key as Stripe does: a key's first successful
answer is kept and replayed to every request with the same key and the same
parameters; the same key with other parameters is a 400 `idempotency_error`;
a request refused before it ran (no such destination) keeps nothing under its
key. `expire_idempotency_keys` forgets every key, as Stripe does once a key is
24 hours old. A test makes Stripe fail with `transfer_fault` (every transfer
request until it is set back to None): SERVER_ERROR (500, nothing made),
LOST_ANSWER (the transfer is made and kept under its key, and the answer is
lost on the way: a 502 from a proxy in between), BALANCE_INSUFFICIENT (400,
nothing made); and a destination in `missing_accounts` is answered "No such
destination" (400)."""
from __future__ import annotations

import hashlib
import hmac
import time
import uuid
from urllib.parse import parse_qs

import orjson

SESSIONS_PATH = "/v1/checkout/sessions/"
TRANSFERS_PATH = "/v1/transfers"
SERVER_ERROR, LOST_ANSWER, BALANCE_INSUFFICIENT = "server_error", "lost_answer", "balance_insufficient"
BAD_GATEWAY_BODY = b"<html><body><h1>502 Bad Gateway</h1></body></html>"


class StripeStandIn:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.sessions_by_key: dict[str, dict] = {}
        self.sessions_by_id: dict[str, dict] = {}
        self.transfers_by_id: dict[str, dict] = {}
        self.transfers_created = 0
        self.idempotent: dict[str, tuple[tuple, dict]] = {}  # key -> (the request, its kept answer)
        self.missing_accounts: set[str] = set()
        self.transfer_fault: str | None = None

    def pay(self, session_id: str, **changes) -> dict:
        """The customer paid: Stripe's session is now paid and complete;
        `changes` (amount_total, currency) make Stripe's record differ from what was asked."""
        session = self.sessions_by_id[session_id]
        session.update({"payment_status": "paid", "status": "complete", **changes})
        return session

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        form = {k: v[0] for k, v in parse_qs(body.decode()).items()}
        query = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
        method, path = scope["method"], scope["path"]
        self.requests.append({"method": method, "path": path, "headers": headers, "form": form, "query": query})
        if method == "POST" and path == "/v1/checkout/sessions":
            status, payload = 200, self._session(headers.get("idempotency-key"), form)
        elif method == "GET" and path.startswith(SESSIONS_PATH):
            status, payload = self._retrieve(path[len(SESSIONS_PATH):])
        elif method == "POST" and path == TRANSFERS_PATH:
            status, payload = self._create_transfer(headers.get("idempotency-key"), form)
        elif method == "GET" and path == TRANSFERS_PATH:
            status, payload = 200, self._list_transfers(query)
        elif method == "GET" and path.startswith(TRANSFERS_PATH + "/"):
            status, payload = self._retrieve_transfer(path[len(TRANSFERS_PATH) + 1:])
        else:
            status, payload = 404, {"error": {"type": "invalid_request_error", "message": "unknown path"}}
        content_type = b"text/html" if isinstance(payload, bytes) else b"application/json"
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.body", "body": payload if isinstance(payload, bytes) else orjson.dumps(payload)})

    def transfer_requests(self) -> list[dict]:
        """Every request to create a transfer, answered or not."""
        return [r for r in self.requests if r["method"] == "POST" and r["path"] == TRANSFERS_PATH]

    def reverse(self, transfer_id: str, amount: int | None = None) -> dict:
        """The platform takes `amount` cents of the transfer back (all that is left when None)."""
        transfer = self.transfers_by_id[transfer_id]
        amount = transfer["amount"] - transfer["amount_reversed"] if amount is None else amount
        reversal = {"id": "trr_" + uuid.uuid4().hex, "object": "transfer_reversal", "amount": amount,
                    "currency": transfer["currency"], "transfer": transfer_id, "created": int(time.time()), "metadata": {}}
        transfer["reversals"]["data"].append(reversal)
        transfer["reversals"]["total_count"] += 1
        transfer["amount_reversed"] += amount
        transfer["reversed"] = transfer["amount_reversed"] == transfer["amount"]
        return transfer

    def expire_idempotency_keys(self) -> None:
        """Every key forgotten, as Stripe forgets a key once it is 24 hours old."""
        self.idempotent.clear()

    def _create_transfer(self, key: str | None, form: dict) -> tuple[int, dict | bytes]:
        if self.transfer_fault == SERVER_ERROR:
            return 500, _error("api_error", "An unknown error occurred", code=None)
        request = ("POST", TRANSFERS_PATH, form)
        if key and key in self.idempotent:
            kept_request, kept = self.idempotent[key]
            if kept_request != request:
                return 400, _error("idempotency_error", f"Keys for idempotent requests can only be used with the same parameters "
                                                        f"they were first used with. Try using a key other than '{key}' if you "
                                                        f"meant to execute a different request.", code=None)
            status, payload = 200, kept
        else:
            status, payload = self._new_transfer(form)
            if key and status == 200:  # the answer as it was then, not the transfer as it becomes
                self.idempotent[key] = (request, orjson.loads(orjson.dumps(payload)))
        if self.transfer_fault == LOST_ANSWER and status == 200:
            return 502, BAD_GATEWAY_BODY
        return status, payload

    def _new_transfer(self, form: dict) -> tuple[int, dict]:
        if self.transfer_fault == BALANCE_INSUFFICIENT:
            return 400, _error("invalid_request_error", "You have insufficient available funds in your Stripe account.",
                               code="balance_insufficient")
        if form["destination"] in self.missing_accounts:
            return 400, _error("invalid_request_error", f"No such destination: '{form['destination']}'",
                               code="resource_missing", param="destination")
        transfer_id = "tr_" + uuid.uuid4().hex
        transfer = {
            "id": transfer_id, "object": "transfer", "amount": int(form["amount"]), "amount_reversed": 0,
            "currency": form["currency"], "destination": form["destination"], "description": form.get("description"),
            "metadata": {k[len("metadata["):-1]: v for k, v in form.items() if k.startswith("metadata[")},
            "transfer_group": form.get("transfer_group"), "reversed": False, "livemode": False, "created": int(time.time()),
            "balance_transaction": "txn_" + uuid.uuid4().hex, "destination_payment": "py_" + uuid.uuid4().hex,
            "reversals": {"object": "list", "data": [], "has_more": False, "total_count": 0,
                          "url": f"{TRANSFERS_PATH}/{transfer_id}/reversals"},
        }
        self.transfers_by_id[transfer_id] = transfer
        self.transfers_created += 1
        return 200, transfer

    def _list_transfers(self, query: dict) -> dict:
        found = [t for t in reversed(self.transfers_by_id.values())
                 if "transfer_group" not in query or t["transfer_group"] == query["transfer_group"]]
        limit = int(query.get("limit", len(found) or 1))
        return {"object": "list", "data": found[:limit], "has_more": len(found) > limit, "url": TRANSFERS_PATH}

    def _retrieve_transfer(self, transfer_id: str) -> tuple[int, dict]:
        if transfer_id not in self.transfers_by_id:
            return 404, _error("invalid_request_error", f"No such transfer: '{transfer_id}'", code="resource_missing", param="id")
        return 200, self.transfers_by_id[transfer_id]

    def _session(self, key: str | None, form: dict) -> dict:
        if key and key in self.sessions_by_key:
            return self.sessions_by_key[key]
        session_id = "cs_test_" + uuid.uuid4().hex
        session = {
            "id": session_id, "object": "checkout.session", "mode": form.get("mode"),
            "url": f"https://checkout.stripe.test/c/pay/{session_id}",
            "amount_total": int(form["line_items[0][price_data][unit_amount]"]) * int(form["line_items[0][quantity]"]),
            "currency": form.get("line_items[0][price_data][currency]"),
            "client_reference_id": form.get("client_reference_id"),
            "metadata": {k[len("metadata["):-1]: v for k, v in form.items() if k.startswith("metadata[")},
            "payment_status": "unpaid", "status": "open",
        }
        if key:
            self.sessions_by_key[key] = session
        self.sessions_by_id[session_id] = session
        return session

    def _retrieve(self, session_id: str) -> tuple[int, dict]:
        if session_id not in self.sessions_by_id:
            return 404, {"error": {"type": "invalid_request_error", "code": "resource_missing",
                                   "message": f"No such checkout.session: '{session_id}'"}}
        return 200, self.sessions_by_id[session_id]


def _error(kind: str, message: str, *, code: str | None, param: str | None = None) -> dict:
    return {"error": {"type": kind, "code": code, "message": message, "param": param}}


def signed(payload: bytes, secret: str, timestamp: int | None = None) -> str:
    """A Stripe-Signature header, by Stripe's documented scheme."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + payload, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def session_event(event_type: str, session: dict, *, paid: bool = True, amount_total: int | None = None) -> bytes:
    obj = {**session, "payment_status": "paid" if paid else "unpaid", "status": "complete"}
    if amount_total is not None:
        obj["amount_total"] = amount_total
    return orjson.dumps({"id": "evt_" + uuid.uuid4().hex, "object": "event", "type": event_type,
                         "api_version": "2026-10-28.endive", "created": int(time.time()), "data": {"object": obj}})


def refund_event(charge_id: str, payment_intent: str, amount: int, amount_refunded: int) -> bytes:
    """charge.refunded: `amount_refunded` is cumulative, as Stripe sends it."""
    charge = {"id": charge_id, "object": "charge", "amount": amount, "amount_refunded": amount_refunded,
              "payment_intent": payment_intent, "refunded": amount_refunded == amount}
    return orjson.dumps({"id": "evt_" + uuid.uuid4().hex, "object": "event", "type": "charge.refunded",
                         "api_version": "2026-10-28.endive", "created": int(time.time()), "data": {"object": charge}})


def dispute_event(event_type: str, dispute_id: str, payment_intent: str, amount: int, status: str) -> bytes:
    dispute = {"id": dispute_id, "object": "dispute", "amount": amount, "charge": "ch_" + payment_intent,
               "payment_intent": payment_intent, "status": status}
    return orjson.dumps({"id": "evt_" + uuid.uuid4().hex, "object": "event", "type": event_type,
                         "api_version": "2026-10-28.endive", "created": int(time.time()), "data": {"object": dispute}})


def transfer_event(event_type: str, transfer: dict) -> bytes:
    """transfer.reversed or transfer.updated, carrying the transfer as it is now."""
    return orjson.dumps({"id": "evt_" + uuid.uuid4().hex, "object": "event", "type": event_type,
                         "api_version": "2026-10-28.endive", "created": int(time.time()), "data": {"object": dict(transfer)}})
