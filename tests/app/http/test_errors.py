"""Typed service errors become statuses in one place, and every error answers
in OpenAI's error shape."""
from __future__ import annotations

import pytest

from app.accounts import NotVisible
from app.http.errors import about_field, http_error_for
from invoices.statements import NoStatement, StatementNotReady
from ledger.errors import InsufficientFunds, InvalidAmount, InvariantBroken, UnknownAccount
from proxy import workers as registry
from proxy.errors import InvalidRequest, ProxyError


@pytest.mark.parametrize(("service_error", "status", "code"), [
    (NotVisible, 404, "not_found"),
    (NoStatement, 404, "not_found"),
    (registry.UnknownWorker, 404, "not_found"),
    (registry.WorkerNotSuspended, 409, "worker_not_suspended"),
    (StatementNotReady, 503, "not_ready"),
    (InvariantBroken, 500, "internal_error"),
    (UnknownAccount, 400, "invalid_request"),
    (InsufficientFunds, 400, "invalid_request"),
])
def test_each_service_error_has_its_status(service_error, status, code):
    error = http_error_for(service_error("what happened"))
    assert (error.status, error.code, str(error)) == (status, code, "what happened")


def test_a_callers_mistake_names_the_field_and_others_keep_their_status():
    with pytest.raises(InvalidRequest) as refused, about_field("amount_usd"):
        raise InvalidAmount("two decimals at most")
    assert refused.value.param == "amount_usd"
    with pytest.raises(ProxyError) as broken, about_field("amount_usd"):
        raise InvariantBroken("the books disagree")
    assert broken.value.status == 500 and broken.value.param is None


def test_errors_answer_in_openais_shape(site):
    before = site.money()
    cases = [
        (site.call("GET", "/v1/account"), 401, "authentication_error"),
        (site.call("GET", "/v1/workers", site.tokens["customer"]), 403, "permission_error"),
        (site.call("DELETE", "/v1/keys/999999", site.tokens["customer"]), 404, "invalid_request_error"),
        (site.call("POST", f"/v1/workers/{site.worker_id}/resume", site.tokens["admin"]), 409, "invalid_request_error"),
        (site.call("GET", "/v1/usage?group_by=nope", site.tokens["customer"]), 400, "invalid_request_error"),
        (site.call("GET", "/v1/no-such-route", site.tokens["customer"]), 404, "invalid_request_error"),  # Litestar's own
    ]
    for response, status, error_type in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == error_type and error["message"]
    assert site.call("GET", "/v1/usage?group_by=nope", site.tokens["customer"]).json()["error"]["param"] == "group_by"
    assert site.money() == before


@pytest.mark.parametrize(("method", "path"), [
    ("DELETE", "/v1/keys/9223372036854775808"), ("DELETE", "/v1/keys/0"), ("GET", "/v1/keys?account_id=9223372036854775808"),
    ("GET", "/v1/invoices?account_id=99999999999999999999"), ("POST", "/v1/workers/9223372036854775808/drain"),
])
def test_an_id_beyond_the_databases_integers_is_a_400_and_moves_nothing(site, method, path):
    """Given ids a BIGINT cannot hold (2^63 and above) or below 1, the API answers
    400 in OpenAI's error shape: it never reaches the database to fail there."""
    before = site.money()
    token = site.tokens["admin"]
    response = site.client.request(method, path, headers={"authorization": f"Bearer {token}"})
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) >= {"message", "type"}
    assert site.money() == before
