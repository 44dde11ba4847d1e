"""Run the Alembic revisions against an engine (what `paralon migrate` does)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine

ROOT = Path(__file__).resolve().parent.parent


def alembic_config() -> Config:
    config = Config(str(ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(ROOT / "migrations"))
    return config


def earlier_revision(file_name: str) -> ModuleType:
    """An earlier revision's module, for a later one that rebuilds or restores a
    database function from the text that revision created it with."""
    path = ROOT / "migrations" / "versions" / file_name
    spec = importlib.util.spec_from_file_location(f"revision_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def migrate(engine: Engine) -> str:
    config = alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "head")
    return "head"
