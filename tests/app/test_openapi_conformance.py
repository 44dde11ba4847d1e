"""The API against the OpenAPI document it serves (/docs/openapi.json), with
Schemathesis: every operation, with each role's token (and an API key, and
none), with data that fits the document and data that does not. No answer is
a 5xx, every status is documented, every body matches its schema (errors
included: one shape, OpenAI's), and data the document rules out is refused.

`paralon serve` runs on PostgreSQL (the store that refuses what SQLite takes,
a NUL in text for one) with a simulated worker, so the inference routes answer
for real. Examples are few and derandomized: the same requests on every run."""
from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from sqlalchemy import select

from app.tokens import ACCOUNTANT, ADMIN, CUSTOMER, OWNER, create_token
from ledger.schema import accounts
from tests.conftest import drop_postgres_database, new_postgres_database
from tests.support.harness import make_fleet, serving, sim_worker

EXAMPLES_PER_OPERATION = 3  # per role and mode: about 600 requests in all
REQUEST_TIMEOUT_S = 30
CALLERS = (CUSTOMER, ACCOUNTANT, OWNER, ADMIN, "api_key", "anonymous")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def served(request):
    url = new_postgres_database(template=request.getfixturevalue("postgres_template"))
    worker = sim_worker("instant")
    fleet = make_fleet(url, [worker.url])
    with fleet.engine.begin() as conn:
        platform = conn.execute(select(accounts.c.id).where(accounts.c.system_code == "platform:revenue")).scalar_one()
        tokens = {CUSTOMER: create_token(conn, fleet.customer_id, CUSTOMER)[1],
                  ACCOUNTANT: create_token(conn, fleet.customer_id, ACCOUNTANT)[1],
                  OWNER: create_token(conn, fleet.owner_ids[0], OWNER)[1],
                  ADMIN: create_token(conn, platform, ADMIN)[1], "api_key": fleet.key, "anonymous": None}
    try:
        with serving(url) as proxy:
            yield fleet, proxy, tokens, schemathesis.openapi.from_url(proxy.url + "/docs/openapi.json")
    finally:
        worker.stop()
        fleet.engine.dispose()
        drop_postgres_database(url)


def _failures_of(operation, mode: GenerationMode, base_url: str, token: str | None) -> list[str]:
    """What the checks found for this operation and mode, one line each (empty: all conform)."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    found: list[str] = []
    try:
        strategy = operation.as_strategy(generation_mode=mode)
    except Exception:  # nothing to negate (no parameters, no body): nothing to send
        return found

    @settings(max_examples=EXAMPLES_PER_OPERATION, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
    @given(case=strategy)
    def run(case) -> None:
        response = case.call(base_url=base_url, headers=headers, timeout=REQUEST_TIMEOUT_S)
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except (AssertionError, BaseExceptionGroup) as failure:
            title = next((line for line in str(failure).splitlines() if line.startswith("- ")), str(failure)[:200])
            found.append(f"{operation.label} [{mode.value}] {title}: {response.status_code} {response.text[:200]}"
                         f"\n    {case.as_curl_command(headers=headers)[:300]}")

    try:
        run()
    except hypothesis.errors.Unsatisfiable:  # every negation the document allows was valid after all
        pass
    return found


@pytest.mark.parametrize("caller", CALLERS)
def test_every_answer_conforms_to_the_served_document(served, caller):
    fleet, proxy, tokens, schema = served
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20, "the document lists every route"
    failures = [failure for operation in operations for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
                for failure in _failures_of(operation, mode, proxy.url, tokens[caller])]
    assert failures == [], "\n".join(failures)
    fleet.assert_books_close()  # what was billed (valid completions) is in the books, and they verify


NOT_ERRORS = {("get", "/ready", "503")}  # /ready answers 503 with its failed checks named, not an error


def test_every_error_in_the_document_has_one_shape(served):
    _, proxy, _, schema = served
    document = schema.raw_schema
    error = document["components"]["schemas"]["Error"]
    assert error["properties"]["error"]["required"] == ["message", "type", "param", "code"]
    for path, item in document["paths"].items():
        for method, operation in item.items():
            for status, response in operation["responses"].items():
                if int(status) >= 400 and (method, path, status) not in NOT_ERRORS:
                    assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}, \
                        (method, path, status)
