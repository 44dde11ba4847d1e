"""The OpenAPI document the service serves (/docs/openapi.json) and the page
that renders it (/docs: Swagger UI 5, which reads OpenAPI 3.1, from the assets
of the `swagger-ui-py` package, served by the app itself: nothing from a CDN).

The document is completed with what Litestar cannot see in handlers that read
their own bodies: the request bodies, the media types of documents, the two
bearer schemes ("Authorize" takes an API key or a management token), and the
errors each route answers, all in one shape (OpenAI's error JSON,
app/http/errors.py), never Litestar's own."""
from __future__ import annotations

from http import HTTPStatus
from importlib.util import find_spec
from pathlib import Path

from litestar import Litestar
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import SwaggerRenderPlugin

from app.limits import DOCS_EXAMPLE_MAX_TOKENS, PAYOUT_DESTINATION_CHARS_MAX
from ledger.commands import PAYOUT_RAILS
from ledger.limits import NAME_CHARS_MAX, REASON_CHARS_MAX
from proxy.limits import EMBEDDING_DIMENSIONS_MAX, EMBEDDING_INPUTS_MAX, MAX_TOKENS_LIMIT

DOCS_PATH = "/docs"
ASSETS_PATH = "/docs/assets"
# Each route names the bearer scheme its guard checks (app/http/guards.py); the open ones name none.
API_KEY_SCHEME, MANAGEMENT_TOKEN_SCHEME = "ApiKey", "ManagementToken"
API_KEY = [{API_KEY_SCHEME: []}]
MANAGEMENT_TOKEN = [{MANAGEMENT_TOKEN_SCHEME: []}]
SECURITY_SCHEMES = {
    API_KEY_SCHEME: {"type": "http", "scheme": "bearer", "bearerFormat": "sk-par-…",
                     "description": "An API key (`sk-par-…`): the OpenAI API (completions, models, generations)."},
    MANAGEMENT_TOKEN_SCHEME: {"type": "http", "scheme": "bearer", "bearerFormat": "pt-par-…",
                              "description": "A management token (`pt-par-…`) of a customer, accountant, owner or admin: "
                                             "the account, keys, workers, top-ups, usage, earnings and documents."},
}


def swagger_ui_assets() -> Path:
    """The Swagger UI 5 files that `swagger-ui-py` ships (its package is not imported: only its files are used)."""
    spec = find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the API docs need the swagger-ui-py package (requirements.lock)")
    return Path(spec.submodule_search_locations[0]) / "static"


def openapi_config() -> OpenAPIConfig:
    return OpenAPIConfig(
        title="Paralon", version="0.1.0", path=DOCS_PATH,
        render_plugins=[SwaggerRenderPlugin(
            js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js", css_url=f"{ASSETS_PATH}/swagger-ui.css",
            standalone_preset_js_url=f"{ASSETS_PATH}/swagger-ui-standalone-preset.js", path="/",
            favicon=f"<link rel='icon' type='image/png' href='{ASSETS_PATH}/favicon-32x32.png'>")],
    )


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
# Every route: a malformed request, no such route or row, the method not taken, and an outage;
# every route behind a bearer scheme: no token or a bad one (and, for a management token, a role that may not).
STATUSES_OF_EVERY_ROUTE = (HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND, HTTPStatus.METHOD_NOT_ALLOWED,
                           HTTPStatus.SERVICE_UNAVAILABLE)
STATUSES_OF_SCHEME = {API_KEY_SCHEME: (HTTPStatus.UNAUTHORIZED,),
                      MANAGEMENT_TOKEN_SCHEME: (HTTPStatus.UNAUTHORIZED, HTTPStatus.FORBIDDEN)}
STATUSES_OF_ROUTE = {
    ("post", "/v1/chat/completions"): (HTTPStatus.PAYMENT_REQUIRED, HTTPStatus.TOO_MANY_REQUESTS, HTTPStatus.BAD_GATEWAY),
    ("post", "/v1/completions"): (HTTPStatus.PAYMENT_REQUIRED, HTTPStatus.TOO_MANY_REQUESTS, HTTPStatus.BAD_GATEWAY),
    ("post", "/v1/embeddings"): (HTTPStatus.PAYMENT_REQUIRED, HTTPStatus.TOO_MANY_REQUESTS, HTTPStatus.BAD_GATEWAY),
    ("post", "/v1/responses"): (HTTPStatus.PAYMENT_REQUIRED, HTTPStatus.TOO_MANY_REQUESTS, HTTPStatus.BAD_GATEWAY),
    ("post", "/v1/workers/{worker_id}/resume"): (HTTPStatus.CONFLICT,),
}
READINESS = {"type": "object", "required": ["status", "checks"], "properties": {
    "status": {"enum": ["ready", "not_ready"]},
    "checks": {"type": "object", "additionalProperties": {"type": "object", "required": ["ok"]}}}}
# The few answers of 400 and above that are not errors: /ready names its failed checks.
NOT_ERRORS = {("get", "/ready", HTTPStatus.SERVICE_UNAVAILABLE): {
    "description": "Not ready: the failed checks are named (with Retry-After)",
    "content": {"application/json": {"schema": READINESS}}}}

PLAIN_USD = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]{1,9})?$", "description": "USD as plain decimal text: 12.50"}
TEXT_OR_NULL = {"type": ["string", "null"], "minLength": 1}
# What the proxy checks of a prompt request (proxy/service.py, proxy/metering.py); other fields
# (temperature, tools, vLLM's top_k, guided_json, …) pass through to the engine as sent.
PROMPT_FIELDS = {
    "model": {"type": "string", "minLength": 1, "description": "A model of GET /v1/models"},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_TOKENS_LIMIT},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "properties": {
        "include_usage": {"type": ["boolean", "null"]}, "continuous_usage_stats": {"type": ["boolean", "null"]}}},
}
TEXT_PART = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "description": "text (or refusal)"}, "text": {"type": "string"}}}
# Only what the proxy checks is typed: fields it forwards unread (name, tool_call_id, a call's id) are
# the engine's to judge, and a document stricter than the service would be untrue.
TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "function": {"type": "object", "description": "{\"name\": …, \"arguments\": \"<JSON text>\"}"}}}
CHAT_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "description": "system, developer, user, assistant or tool"},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}, {"type": "null"}]},
    "tool_calls": {"type": ["array", "null"], "items": TOOL_CALL}}}
CHAT_REQUEST = {
    "type": "object", "required": ["model", "messages"],
    "description": "OpenAI's chat completion request; the fields not named here pass through to the worker.",
    "properties": {**PROMPT_FIELDS,
                   "messages": {"type": "array", "minItems": 1, "items": CHAT_MESSAGE},
                   "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_TOKENS_LIMIT},
                   "tools": {"type": ["array", "null"]}},
    "example": {"model": "paralon-test", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": DOCS_EXAMPLE_MAX_TOKENS},
}
COMPLETION_REQUEST = {
    "type": "object", "required": ["model", "prompt"],
    "description": "OpenAI's (legacy) completion request; the fields not named here pass through to the worker.",
    "properties": {**PROMPT_FIELDS, "prompt": {"anyOf": [
        {"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}},
        {"type": "array", "minItems": 1, "items": {"type": "integer"}}]}},
    "example": {"model": "paralon-test", "prompt": "Once upon a time", "max_tokens": DOCS_EXAMPLE_MAX_TOKENS},
}
RESPONSE_REQUEST = {
    "type": "object", "required": ["model", "input"],
    "description": "OpenAI's Responses request: input as text or items (messages, function_call, function_call_output).",
    "properties": {
        "model": PROMPT_FIELDS["model"], "stream": PROMPT_FIELDS["stream"],
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "instructions": {"type": ["string", "null"]},
        "previous_response_id": {"type": ["string", "null"], "description": "A response of this account, continued"},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_TOKENS_LIMIT},
        "tools": {"type": ["array", "null"]}},
    "example": {"model": "paralon-test", "input": "Say hello", "max_output_tokens": DOCS_EXAMPLE_MAX_TOKENS},
}
STRIPE_EVENT = {
    "type": "object", "required": ["id", "type"],
    "description": "A Stripe event, verified against the `Stripe-Signature` header with the endpoint secret.",
    "properties": {"id": {"type": "string"}, "type": {"type": "string"}, "data": {"type": "object"}},
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
        "name": {**TEXT_OR_NULL, "maxLength": NAME_CHARS_MAX}, "spend_limit_usd": {**PLAIN_USD, "type": ["string", "null"]}},
        "example": {"name": "laptop", "spend_limit_usd": "5.00"}},
    ("post", "/v1/credits/checkout"): {"type": "object", "required": ["amount_usd"], "properties": {"amount_usd": PLAIN_USD},
                                       "example": {"amount_usd": "25.00"}},
    ("put", "/v1/account/low-balance-alert"): {
        "type": "object", "required": ["threshold_usd"], "properties": {"threshold_usd": {
            "type": ["string", "null"], "pattern": r"^[0-9]+(\.[0-9]{1,2})?$",
            "description": "USD with two decimals at most, above zero; null turns the alert off"}},
        "example": {"threshold_usd": "2.00"}},
    ("post", "/v1/payouts"): {"type": "object", "required": ["amount_usd", "rail"], "properties": {
        "amount_usd": PLAIN_USD, "rail": {"enum": list(PAYOUT_RAILS)}}, "example": {"amount_usd": "50.00", "rail": "usdc"}},
    ("put", "/v1/payouts/destination"): {"type": "object", "required": ["rail", "destination"], "properties": {
        "rail": {"enum": list(PAYOUT_RAILS)},
        "destination": {"type": "string", "minLength": 1, "maxLength": PAYOUT_DESTINATION_CHARS_MAX,
                        "description": "an EVM address (0x…) for usdc, a connected account id (acct_…) for stripe"},
        "weekly": {"type": "boolean", "description": "pay out every Monday whatever exceeds the minimum"}},
        "example": {"rail": "usdc", "destination": "0x00000000000000000000000000000000000000A1"}},
    ("post", "/v1/workers/{worker_id}/resume"): {"type": "object", "properties": {
        "reason": {"type": "string", "minLength": 1, "maxLength": REASON_CHARS_MAX}}},
    ("post", "/v1/chat/completions"): {"$ref": "#/components/schemas/ChatCompletionRequest"},
    ("post", "/v1/completions"): {"$ref": "#/components/schemas/CompletionRequest"},
    ("post", "/webhooks/stripe"): {"$ref": "#/components/schemas/StripeEvent"},
    ("post", "/v1/responses"): {"$ref": "#/components/schemas/ResponseRequest"},
    ("post", "/v1/embeddings"): {"type": "object", "required": ["model", "input"], "properties": {
        "model": {"type": "string", "minLength": 1}, "input": EMBEDDING_INPUT,
        "encoding_format": {"enum": ["float", "base64"]},
        "dimensions": {"type": "integer", "minimum": 1, "maximum": EMBEDDING_DIMENSIONS_MAX}}},
}
NAMED_SCHEMAS = {"Error": ERROR_SCHEMA, "ChatCompletionRequest": CHAT_REQUEST, "CompletionRequest": COMPLETION_REQUEST,
                 "ResponseRequest": RESPONSE_REQUEST, "StripeEvent": STRIPE_EVENT}
OPTIONAL_BODIES = {("post", "/v1/keys"), ("post", "/v1/workers/{worker_id}/resume")}
BINARY = {"type": "string", "format": "binary"}
# What a success answers when it is not JSON.
SUCCESS_CONTENT = {
    ("get", "/v1/invoices/{name}"): {"application/pdf": {"schema": BINARY}},
    ("get", "/v1/invoices.zip"): {"application/zip": {"schema": BINARY}},
    ("get", "/v1/payouts/{name}"): {"application/json": {"schema": {}}, "application/pdf": {"schema": BINARY}},
    ("get", "/v1/statements/{name}"): {"application/pdf": {"schema": BINARY}, "application/json": {"schema": {}}},
    ("get", "/v1/exports/ledger.csv"): {"text/csv": {"schema": {"type": "string"}}},
    ("get", "/metrics"): {"text/plain": {"schema": {"type": "string"}}},
    ("post", "/v1/chat/completions"): {"application/json": {"schema": {}}, "text/event-stream": {"schema": {"type": "string"}}},
    ("post", "/v1/completions"): {"application/json": {"schema": {}}, "text/event-stream": {"schema": {"type": "string"}}},
    ("post", "/v1/responses"): {"application/json": {"schema": {}}, "text/event-stream": {"schema": {"type": "string"}}},
}


def complete_openapi(app: Litestar) -> None:
    """Completes the document once, before the first request asks for it (an on_startup hook)."""
    # The dict the schema routes serve, built once and kept by Litestar's OpenAPI plugin.
    document = app.plugins.get("OpenAPIPlugin").provide_openapi_schema()
    components = document.setdefault("components", {})
    components.setdefault("schemas", {}).update(NAMED_SCHEMAS)
    components["securitySchemes"] = SECURITY_SCHEMES
    for path, item in document.get("paths", {}).items():
        for method, operation in item.items():
            if isinstance(operation, dict) and "responses" in operation:
                _complete_operation(method, path, operation)


def _complete_operation(method: str, path: str, operation: dict) -> None:
    responses = operation["responses"]
    statuses = [*STATUSES_OF_EVERY_ROUTE, *STATUSES_OF_ROUTE.get((method, path), ())]
    for requirement in operation.get("security", ()):
        statuses += [status for scheme in requirement for status in STATUSES_OF_SCHEME[scheme]]
    for status in statuses:  # replaces Litestar's own 400 shape, which this service never answers
        responses[str(int(status))] = NOT_ERRORS.get((method, path, status)) or {
            "description": ERROR_DESCRIPTIONS[status], "content": {"application/json": {"schema": ERROR_REF}}}
    if (method, path) in SUCCESS_CONTENT:
        for response in responses.values():
            if "content" in response and response["content"].get("application/json", {}).get("schema") != ERROR_REF:
                response["content"] = SUCCESS_CONTENT[(method, path)]
    if (method, path) in REQUEST_BODIES:
        operation["requestBody"] = {"required": (method, path) not in OPTIONAL_BODIES,
                                    "content": {"application/json": {"schema": REQUEST_BODIES[(method, path)]}}}
