"""Workers served over TLS (`https://`), end to end: a simulated worker with a
certificate from a private CA, `paralon serve` told to trust that CA through
PARALON_WORKER_CA_BUNDLE, the official SDK as the caller."""
from __future__ import annotations

import threading

import openai
import pytest
import uvicorn

from proxy.sim.worker import build_app
from tests.proxy.tls import ServerCertificate, make_server_certificate
from tests.support.harness import MODEL, ThreadedServer, make_fleet, serving

MESSAGES = [{"role": "user", "content": "Say something."}]


class TlsServer(ThreadedServer):
    """An ASGI app on uvicorn over TLS, in a background thread."""

    def __init__(self, app, tls: ServerCertificate) -> None:
        super().__init__(app)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False, lifespan="off", ssl_certfile=str(tls.certificate),
                                                    ssl_keyfile=str(tls.key)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


@pytest.fixture
def tls_worker(tmp_path):
    tls = make_server_certificate(tmp_path / "certificates", "workers")
    worker = TlsServer(build_app("instant", MODEL), tls).start()
    yield worker, tls
    worker.stop()


def _fleet(tmp_path, worker):
    return make_fleet(f"sqlite:///{tmp_path}/paralon.db", [worker.url])


def test_a_worker_on_a_trusted_private_ca_serves_and_is_billed(tmp_path, tls_worker):
    worker, tls = tls_worker
    fleet = _fleet(tmp_path, worker)
    with serving(fleet.database_url, PARALON_WORKER_CA_BUNDLE=str(tls.ca_bundle)) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)
        answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
        chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True))
    assert answer.usage.completion_tokens == 5
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    settlements = fleet.settlements()
    assert len(settlements) == 2 and all(s["charge_nano_usd"] > 0 for s in settlements)
    charged = sum(s["charge_nano_usd"] for s in settlements)
    assert fleet.balance(fleet.customer_id).balance_nano_usd == 10 * 10**9 - charged
    fleet.assert_books_close()
    fleet.engine.dispose()


def test_a_worker_whose_certificate_is_not_trusted_gets_no_traffic_and_no_money_moves(tmp_path, tls_worker):
    worker, _ = tls_worker
    other_ca = make_server_certificate(tmp_path / "other", "other").ca_bundle
    fleet = _fleet(tmp_path, worker)
    before = fleet.balance(fleet.customer_id)
    with serving(fleet.database_url, PARALON_WORKER_CA_BUNDLE=str(other_ca)) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    assert refused.value.status_code == 503
    assert fleet.worker(fleet.worker_ids[0]).healthy is False
    assert fleet.settlements() == [] and fleet.balance(fleet.customer_id) == before
    assert worker.app.state.requests_started == 0, "nothing reached the worker"
    fleet.engine.dispose()
