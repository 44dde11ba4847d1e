"""The OpenAPI document the service serves (/docs/openapi.json), completed with
what Litestar cannot see in handlers that read their own bodies: the request
bodies, the media types of documents, and the errors each route answers, all
in one shape (OpenAI's error JSON, app/http/errors.py), never Litestar's own."""
from __future__ import annotations

from http import HTTPStatus

from litestar import Litestar

from ledger.limits import NAME_CHARS_MAX, REASON_CHARS_MAX
from proxy.limits import EMBEDDING_DIMENSIONS_MAX, EMBEDDING_INPUTS_MAX

ERROR_REF = {"$ref": "#/components/schemas/Error"}
ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "description": "Every error answers in OpenAI's error shape.",
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
ERROR_DESCRIPTIONS = {
    HTTPStatus.BAD_REQUEST: "The request is malformed or refused; nothing was written",
    HTTPStatus.UNAUTHORIZED: "No bearer token, or an unknown or revoked one",
    HTTPStatus.PAYMENT_REQUIRED: "Not enough credits",
    HTTPStatus.FORBIDDEN: "The token's role may not do this",
    HTTPStatus.NOT_FOUND: "Not there, or not the caller's to see",
    HTTPStatus.METHOD_NOT_ALLOWED: "The route does not take this method",
    HTTPStatus.CONFLICT: "The resource is not in a state that allows this",
    HTTPStatus.TOO_MANY_REQUESTS: "The key's spend limit is reached",
    HTTPStatus.BAD_GATEWAY: "The worker failed",
    HTTPStatus.SERVICE_UNAVAILABLE: "Not ready, or no worker or database available; retry later",
}
# Every route: a malformed request, no such route or row, the method not taken, and an outage.
STATUSES_OF_EVERY_ROUTE = (HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND, HTTPStatus.METHOD_NOT_ALLOWED,
                           HTTPStatus.SERVICE_UNAVAILABLE)
STATUSES_OF_GUARDED_ROUTES = (HTTPStatus.UNAUTHORIZED, HTTPStatus.FORBIDDEN)
OPEN_PATHS = ("/health", "/metrics", "/webhooks/stripe")  # no bearer token
STATUSES_OF_ROUTE = {
    ("post", "/v1/chat/completions"): (HTTPStatus.PAYMENT_REQUIRED, HTTPStatus.TOO_MANY_REQUESTS, HTTPStatus.BAD_GATEWAY),
    ("post", "/v1/completions"): (HTTPStatus.PAYMENT_REQUIRED, HTTPStatus.TOO_MANY_REQUESTS, HTTPStatus.BAD_GATEWAY),
    ("post", "/v1/embeddings"): (HTTPStatus.PAYMENT_REQUIRED, HTTPStatus.TOO_MANY_REQUESTS, HTTPStatus.BAD_GATEWAY),
    ("post", "/v1/workers/{worker_id}/resume"): (HTTPStatus.CONFLICT,),
}

PLAIN_USD = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]{1,9})?$", "description": "USD as plain decimal text: 12.50"}
TEXT_OR_NULL = {"type": ["string", "null"], "minLength": 1}
PROMPT_FIELDS = {
    "model": {"type": "string", "minLength": 1},
    "max_tokens": {"type": "integer", "minimum": 1},
    "stream": {"type": "boolean"},
}
TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
EMBEDDING_INPUT = {"oneOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "maxItems": EMBEDDING_INPUTS_MAX, "items": {"type": "string", "minLength": 1}},
    {**TOKEN_IDS, "maxItems": EMBEDDING_INPUTS_MAX},
    {"type": "array", "minItems": 1, "maxItems": EMBEDDING_INPUTS_MAX, "items": TOKEN_IDS},
]}
REQUEST_BODIES = {
    ("post", "/v1/keys"): {"type": "object", "properties": {
        "name": {**TEXT_OR_NULL, "maxLength": NAME_CHARS_MAX}, "spend_limit_usd": {**PLAIN_USD, "type": ["string", "null"]}}},
    ("post", "/v1/credits/checkout"): {"type": "object", "required": ["amount_usd"], "properties": {"amount_usd": PLAIN_USD}},
    ("post", "/v1/workers/{worker_id}/resume"): {"type": "object", "properties": {
        "reason": {"type": "string", "minLength": 1, "maxLength": REASON_CHARS_MAX}}},
    ("post", "/v1/chat/completions"): {"type": "object", "required": ["model", "messages"], "properties": {
        **PROMPT_FIELDS, "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"enum": ["system", "user", "assistant"]}, "content": {"type": "string"}}}}}},
    ("post", "/v1/completions"): {"type": "object", "required": ["model", "prompt"], "properties": {
        **PROMPT_FIELDS, "prompt": {"type": "string"}}},
    ("post", "/v1/embeddings"): {"type": "object", "required": ["model", "input"], "properties": {
        "model": {"type": "string", "minLength": 1}, "input": EMBEDDING_INPUT,
        "encoding_format": {"enum": ["float", "base64"]},
        "dimensions": {"type": "integer", "minimum": 1, "maximum": EMBEDDING_DIMENSIONS_MAX}}},
}
OPTIONAL_BODIES = {("post", "/v1/keys"), ("post", "/v1/workers/{worker_id}/resume")}
BINARY = {"type": "string", "format": "binary"}
# What a success answers when it is not JSON.
SUCCESS_CONTENT = {
    ("get", "/v1/invoices/{name}"): {"application/pdf": {"schema": BINARY}},
    ("get", "/v1/statements/{name}"): {"application/pdf": {"schema": BINARY}, "application/json": {"schema": {}}},
    ("get", "/v1/exports/ledger.csv"): {"text/csv": {"schema": {"type": "string"}}},
    ("get", "/metrics"): {"text/plain": {"schema": {"type": "string"}}},
    ("post", "/v1/chat/completions"): {"application/json": {"schema": {}}, "text/event-stream": {"schema": {"type": "string"}}},
    ("post", "/v1/completions"): {"application/json": {"schema": {}}, "text/event-stream": {"schema": {"type": "string"}}},
}


def complete_openapi(app: Litestar) -> None:
    """Completes the document once, before the first request asks for it (an on_startup hook)."""
    # The dict the schema routes serve, built once and kept by Litestar's OpenAPI plugin.
    document = app.plugins.get("OpenAPIPlugin").provide_openapi_schema()
    document.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    for path, item in document.get("paths", {}).items():
        for method, operation in item.items():
            if isinstance(operation, dict) and "responses" in operation:
                _complete_operation(method, path, operation)


def _complete_operation(method: str, path: str, operation: dict) -> None:
    responses = operation["responses"]
    statuses = [*STATUSES_OF_EVERY_ROUTE, *STATUSES_OF_ROUTE.get((method, path), ())]
    if path not in OPEN_PATHS:
        statuses += STATUSES_OF_GUARDED_ROUTES
    for status in statuses:  # replaces Litestar's own 400 shape, which this service never answers
        responses[str(int(status))] = {"description": ERROR_DESCRIPTIONS[status],
                                  "content": {"application/json": {"schema": ERROR_REF}}}
    if (method, path) in SUCCESS_CONTENT:
        for response in responses.values():
            if "content" in response and response["content"].get("application/json", {}).get("schema") != ERROR_REF:
                response["content"] = SUCCESS_CONTENT[(method, path)]
    if (method, path) in REQUEST_BODIES:
        operation["requestBody"] = {"required": (method, path) not in OPTIONAL_BODIES,
                                    "content": {"application/json": {"schema": REQUEST_BODIES[(method, path)]}}}
