"""The harness starts a server on a port chosen free: another test's server may bind it first."""
from __future__ import annotations

import httpx

from tests.support import harness


def test_a_process_whose_free_port_was_taken_starts_on_another(monkeypatch):
    """Another server answering /health on the port is not taken for ours: ours exits (the
    address is in use) and starts again on a fresh port, and answers there from its own socket."""
    squatter = harness.sim_worker()  # answers /health on the port the worker will be given first
    taken = int(squatter.url.rsplit(":", 1)[1])
    ports = iter([taken])
    real_free_port = harness.free_port
    monkeypatch.setattr(harness, "free_port", lambda: next(ports, None) or real_free_port())
    worker = harness.SimWorkerProcess()
    try:
        assert worker.port == taken
        worker.start()
        assert worker.port != taken
        assert harness._listens_on(worker.process.pid, worker.port)
        assert httpx.get(worker.url + "/health", timeout=5).status_code == 200
    finally:
        worker.stop()
        squatter.stop()
