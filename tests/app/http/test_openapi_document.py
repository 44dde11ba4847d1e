"""The OpenAPI document says what the service does: each route that reads a
body documents it, each guarded route names the bearer scheme its guard checks
(and the open ones none), every query parameter a handler reads is declared
(`from` too, a Python keyword), every error is OpenAI's shape as the routes
really answer it, and /docs renders it with Swagger UI 5 from the app's own
files."""
from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pytest

from app.http.openapi import API_KEY_SCHEME, MANAGEMENT_TOKEN_SCHEME

HTTP_DIR = Path(__file__).resolve().parents[3] / "app" / "http"
API_KEY_ROUTES = {("post", "/v1/chat/completions"), ("post", "/v1/completions"), ("get", "/v1/models"),
                  ("get", "/v1/generations/{request_id}"), ("get", "/v1/models/{model}"),
                  ("post", "/v1/responses"), ("post", "/v1/embeddings")}
OPEN_ROUTES = {("get", "/health"), ("get", "/ready"), ("get", "/metrics"), ("post", "/webhooks/stripe")}
BODIES = {("post", "/v1/chat/completions"), ("post", "/v1/completions"), ("post", "/v1/keys"),
          ("post", "/v1/responses"), ("post", "/v1/embeddings"),
          ("post", "/v1/credits/checkout"), ("post", "/v1/workers/{worker_id}/resume"), ("post", "/webhooks/stripe"),
          ("put", "/v1/account/low-balance-alert"), ("post", "/v1/payouts"), ("put", "/v1/payouts/destination")}
BODILESS_POSTS = {("post", "/v1/workers/{worker_id}/drain")}  # a POST that reads nothing of the request but its path
NOT_ERRORS = {("get", "/ready", "503")}  # /ready names its failed checks


@pytest.fixture
def document(site) -> dict:
    return site.client.get("/docs/openapi.json").json()


def _operations(document: dict) -> dict[tuple[str, str], dict]:
    return {(method, path): operation for path, item in document["paths"].items() for method, operation in item.items()}


def _request_path(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "1", path)


def test_every_route_that_reads_a_body_documents_it(document):
    operations = _operations(document)
    assert {route for route, operation in operations.items() if "requestBody" in operation} == BODIES
    assert {route for route in operations if route[0] in ("post", "put")} == BODIES | BODILESS_POSTS
    schemas = document["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert chat["required"] == ["model", "messages"] and chat["properties"]["messages"]["minItems"] == 1
    assert schemas["CompletionRequest"]["required"] == ["model", "prompt"]
    assert operations[("post", "/v1/chat/completions")]["requestBody"]["required"] is True
    assert operations[("post", "/v1/keys")]["requestBody"]["required"] is False  # both fields optional, so the body


def test_each_route_names_the_bearer_scheme_its_guard_checks(site, document):
    schemes = document["components"]["securitySchemes"]
    assert schemes[API_KEY_SCHEME] == {**schemes[API_KEY_SCHEME], "type": "http", "scheme": "bearer"}
    assert schemes[MANAGEMENT_TOKEN_SCHEME] == {**schemes[MANAGEMENT_TOKEN_SCHEME], "type": "http", "scheme": "bearer"}
    for (method, path), operation in _operations(document).items():
        expected = (None if (method, path) in OPEN_ROUTES else
                    [{API_KEY_SCHEME: []}] if (method, path) in API_KEY_ROUTES else [{MANAGEMENT_TOKEN_SCHEME: []}])
        assert operation.get("security") == expected, (method, path)
        assert ("401" in operation["responses"]) == (expected is not None), (method, path)
        assert ("403" in operation["responses"]) == (expected == [{MANAGEMENT_TOKEN_SCHEME: []}]), (method, path)  # roles
        # What the guard does: without a token a guarded route answers 401, an open one never does.
        unauthenticated = site.call(method.upper(), _request_path(path), json={})
        assert (unauthenticated.status_code == 401) == (expected is not None), (method, path, unauthenticated.text)
        if expected is not None:  # and the other scheme's token is refused as well
            other = site.key if API_KEY_SCHEME not in expected[0] else site.tokens["admin"]
            assert site.call(method.upper(), _request_path(path), other, json={}).status_code == 401, (method, path)


def test_every_query_parameter_is_declared(site, document):
    operations = _operations(document)
    for route in (("get", "/v1/invoices"), ("get", "/v1/exports/ledger.csv")):
        names = {p["name"] for p in operations[route]["parameters"] if p["in"] == "query"}
        assert {"from", "to", "account_id"} <= names, route
    for module in HTTP_DIR.glob("*.py"):  # a handler reading the query itself would hide a parameter from the document
        assert "query_params" not in module.read_text(), module.name
    customer = site.tokens["customer"]
    assert site.call("GET", "/v1/invoices?from=2026-01&to=2026-02", customer).status_code == 200
    refused = site.call("GET", "/v1/invoices?from=January", customer)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "from"
    assert site.call("GET", "/v1/exports/ledger.csv?from=2020-01", customer).status_code == 200
    assert site.call("GET", "/v1/exports/ledger.csv?from=May", customer).json()["error"]["param"] == "from"


def test_every_error_is_the_error_schema_the_routes_answer(site, document):
    error_schema = document["components"]["schemas"]["Error"]
    for (method, path), operation in _operations(document).items():
        for status, response in operation["responses"].items():
            if int(status) >= 400 and (method, path, status) not in NOT_ERRORS:
                assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}, \
                    (method, path, status)
    answers = [site.call("GET", "/v1/account"), site.call("GET", "/v1/account", site.key),
               site.call("GET", "/v1/workers", site.tokens["customer"]), site.call("GET", "/v1/nothing-here"),
               site.call("PUT", "/v1/account", site.tokens["customer"]),
               site.call("POST", "/v1/chat/completions", site.key, content=b"{not json"),
               site.call("POST", "/v1/keys", site.tokens["customer"], json={"spend_limit_usd": 5})]
    assert [answer.status_code for answer in answers] == [401, 401, 403, 404, 405, 400, 400]
    for answer in answers:
        jsonschema.validate(answer.json(), error_schema)


def test_the_docs_page_loads_swagger_ui_5_from_the_app_itself(site, document):
    page = site.client.get("/docs")
    assert page.status_code == 200 and document["openapi"].startswith("3.1")
    sources = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
    assert sources and all(source.startswith("/docs/assets/") for source in sources), sources
    for source in sources:
        assert site.client.get(source).status_code == 200, source
    bundle = site.client.get("/docs/assets/swagger-ui-bundle.js").text
    assert re.search(r'PACKAGE_VERSION:"5\.', bundle), "Swagger UI 5 reads OpenAPI 3.1; 4 cannot"
    assert '"securitySchemes"' in page.text  # the completed document is the one the page embeds
