"""What the proxy's tests share."""
from __future__ import annotations

import pytest

from app.migrate import migrate
from ledger.db import make_engine


@pytest.fixture
def registry_engine(tmp_path):
    """A migrated SQLite database of the test's own, for the worker registry."""
    engine = make_engine(f"sqlite:///{tmp_path}/registry.db")
    migrate(engine)
    yield engine
    engine.dispose()
