"""A local stand-in for the part of Stripe's API that Paralon calls: creating
Checkout Sessions (form-encoded, honouring Idempotency-Key) and retrieving
them, so that the real `stripe` SDK runs end to end offline. It records every
request it got. A session is unpaid until the test pays it (`pay`), as on
Stripe until the customer pays."""
from __future__ import annotations

import hashlib
import hmac
import time
import uuid
from urllib.parse import parse_qs

import orjson

SESSIONS_PATH = "/v1/checkout/sessions/"


class StripeStandIn:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.sessions_by_key: dict[str, dict] = {}
        self.sessions_by_id: dict[str, dict] = {}

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
        self.requests.append({"path": scope["path"], "headers": headers, "form": form})
        if scope["method"] == "POST" and scope["path"] == "/v1/checkout/sessions":
            status, payload = 200, self._session(headers.get("idempotency-key"), form)
        elif scope["method"] == "GET" and scope["path"].startswith(SESSIONS_PATH):
            status, payload = self._retrieve(scope["path"][len(SESSIONS_PATH):])
        else:
            status, payload = 404, {"error": {"type": "invalid_request_error", "message": "unknown path"}}
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": orjson.dumps(payload)})

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
