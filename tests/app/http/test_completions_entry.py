"""The completions routes' own ASGI entry (app/http/completions_entry.py)
answers as Litestar's route does: the same statuses, error JSON and headers,
the key checked before the body is read, the same body limit, and nothing
held for a request it refuses. Every other request, and a browser's while
CORS is on, goes through Litestar."""
from __future__ import annotations

import orjson
import pytest

from app.http.completions_entry import CompletionsEntry
from tests.app.http.conftest import MODEL

CHAT = "/v1/chat/completions"
GOOD_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _entry(site) -> CompletionsEntry:
    entry = site.client.app.asgi_handler
    assert isinstance(entry, CompletionsEntry), "the app answers completions through its own entry"
    return entry


def _answer(response) -> tuple:
    headers = {name: response.headers.get(name) for name in ("content-type", "retry-after", "x-should-retry")}
    return response.status_code, response.json(), headers


# (what is wrong, the request's headers given the site, its body)
BAD_REQUESTS = [
    ("no key", lambda site: {}, GOOD_BODY),
    ("not bearer", lambda site: {"authorization": f"Basic {site.key}"}, GOOD_BODY),
    ("unknown key", lambda site: {"authorization": "Bearer sk-par-unknown"}, GOOD_BODY),
    ("management token", lambda site: {"authorization": f"Bearer {site.tokens['customer']}"}, GOOD_BODY),
    ("not json", lambda site: {"authorization": f"Bearer {site.key}"}, b"{not json"),
    ("not an object", lambda site: {"authorization": f"Bearer {site.key}"}, [GOOD_BODY]),
    ("no model", lambda site: {"authorization": f"Bearer {site.key}"}, {"messages": GOOD_BODY["messages"]}),
    ("unknown model", lambda site: {"authorization": f"Bearer {site.key}"}, {**GOOD_BODY, "model": "nope"}),
    ("bad max_tokens", lambda site: {"authorization": f"Bearer {site.key}"}, {**GOOD_BODY, "max_tokens": -1}),
    ("no worker answers", lambda site: {"authorization": f"Bearer {site.key}"}, GOOD_BODY),
]


@pytest.mark.parametrize(("wrong", "headers_of", "body"), BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS])
def test_a_refused_request_is_answered_as_litestars_route_answers_it_and_moves_no_money(site, wrong, headers_of, body):
    entry, before = _entry(site), site.money()
    send = {"content": body} if isinstance(body, bytes) else {"json": body}
    through_entry = _answer(site.client.post(CHAT, headers=headers_of(site), **send))
    site.client.app.asgi_handler = entry.litestar_handler
    try:
        through_litestar = _answer(site.client.post(CHAT, headers=headers_of(site), **send))
    finally:
        site.client.app.asgi_handler = entry
    assert through_entry == through_litestar
    assert through_entry[0] >= 400 and through_entry[1]["error"]["message"], wrong
    assert site.money() == before, "a refused request moves no money"


def test_completions_take_the_entry_and_every_other_route_litestars(site):
    entry, reached_litestar = _entry(site), []
    litestar_handler = entry.litestar_handler

    async def counted(scope, receive, send):
        reached_litestar.append((scope["method"], scope["path"]))
        await litestar_handler(scope, receive, send)

    entry.litestar_handler = counted
    auth = {"authorization": f"Bearer {site.key}"}
    assert site.client.post(CHAT, headers=auth, json={**GOOD_BODY, "model": "nope"}).status_code == 404
    assert site.client.post("/v1/completions", headers=auth, json={"model": "nope", "prompt": "hi"}).status_code == 404
    assert reached_litestar == []
    assert site.client.get("/v1/models", headers=auth).status_code == 200
    assert site.client.get(CHAT, headers=auth).status_code == 405  # a method the route does not take: Litestar's 405
    assert reached_litestar == [("GET", "/v1/models"), ("GET", CHAT)]


def test_a_body_over_the_limit_is_a_413_whether_declared_or_streamed_and_holds_nothing(site):
    entry, before = _entry(site), site.money()
    entry.body_bytes_max = 1_000
    auth = {"authorization": f"Bearer {site.key}"}
    big = {**GOOD_BODY, "messages": [{"role": "user", "content": "x" * 2_000}]}
    declared = site.client.post(CHAT, headers=auth, json=big)
    streamed = site.client.post(CHAT, headers=auth, content=iter([b'{"model": "', b"x" * 600, b'", "pad": "', b"y" * 600, b'"}']))
    assert (declared.status_code, streamed.status_code) == (413, 413)
    assert declared.json()["error"]["type"] == "invalid_request_error"
    small = site.client.post(CHAT, headers=auth, json={**GOOD_BODY, "model": "nope"})
    assert small.status_code == 404, "a body within the limit is read"
    assert site.money() == before


def test_the_key_is_checked_before_the_body_is_read(site):
    entry = _entry(site)
    entry.body_bytes_max = 10
    refused = site.client.post(CHAT, json=GOOD_BODY)  # no key, and a body over the limit
    assert refused.status_code == 401


def test_of_a_repeated_authorization_header_the_first_counts_as_on_litestars_route(site):
    """Sent as two lines (the test client would join them into one)."""
    entry, body = _entry(site), orjson.dumps({**GOOD_BODY, "model": "nope"})
    good, unknown = (b"authorization", f"Bearer {site.key}".encode()), (b"authorization", b"Bearer sk-par-unknown")
    statuses = {}
    for path, handler in (("entry", entry), ("litestar", entry.litestar_handler)):
        site.client.app.asgi_handler = handler
        try:
            statuses[path] = [site.client.blocking_portal.call(_post_raw, site.client.app, headers, body)
                              for headers in ([good, unknown], [unknown, good])]
        finally:
            site.client.app.asgi_handler = entry
    assert statuses == {"entry": [404, 401], "litestar": [404, 401]}


async def _post_raw(app, headers: list[tuple[bytes, bytes]], body: bytes) -> int:
    """The status of one POST to the chat route, its headers exactly as given."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("testserver", 80), "headers": [*headers, (b"content-length", str(len(body)).encode())]}
    messages, sent = [{"type": "http.request", "body": body, "more_body": False}], []

    async def receive() -> dict:
        return messages.pop() if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"]
