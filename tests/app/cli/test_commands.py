"""Every command of `paralon`, its arguments, options, defaults, choices and
help text, as recorded in commands.json: a change to the command line shows
here first. After an intended change, write the record again with
`python -m tests.app.cli.test_commands` and read the diff."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
from click.testing import CliRunner

from app.cli import main

RECORD = Path(__file__).with_name("commands.json")


def _param(param: click.Parameter) -> dict:
    """Its name, declarations, type (with choices and ranges), default, help, as plain JSON."""
    return json.loads(json.dumps(param.to_info_dict(), default=repr))


def describe(command: click.Command = main, path: tuple[str, ...] = ()) -> dict[str, dict]:
    """Each command by its path ("" for `paralon` itself): parameters, settings and --help text."""
    help_text = CliRunner().invoke(main, [*path, "--help"], catch_exceptions=False).output
    described = {" ".join(path): {"group": isinstance(command, click.Group), "params": [_param(p) for p in command.params],
                                  "context_settings": {k: repr(v) for k, v in sorted(command.context_settings.items())},
                                  "help": help_text}}
    if isinstance(command, click.Group):
        for name in command.list_commands(click.Context(command)):
            described.update(describe(command.get_command(click.Context(command), name), (*path, name)))
    return described


def test_every_command_option_and_help_text_is_as_recorded():
    recorded = json.loads(RECORD.read_text())
    now = describe()
    assert sorted(now) == sorted(recorded), "the same commands"
    for path, described in recorded.items():
        assert now[path] == described, f"`paralon {path}` changed"


def test_a_command_imports_only_its_own_module():
    """`paralon balance` does not wait for web3, Celery or Litestar to import."""
    program = ("import sys; from app.cli import main; main(['balance', '--help'], standalone_mode=False); "
               "print(sorted(m for m in ('web3', 'celery', 'litestar', 'app.cli.payments', 'app.cli.servers') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout.splitlines()[-1]
    assert loaded == "[]"


def test_the_service_loads_no_chain_library_where_no_chain_is_configured(tmp_path):
    """`paralon serve` and the Celery app start without web3 (about a second of
    imports) unless a seed or a payout wallet is set."""
    program = ("import sys; from app import wiring; from app.settings import Settings; from app.http.factory import create_app; "
               "import app.http.server, app.jobs.celery; settings = Settings.from_env(); "
               "create_app(wiring.open_ledger(settings), crypto_settings=wiring.crypto_settings(settings)); "
               "wiring.payout_chain_settings(settings); "
               "print(sorted(m for m in ('web3', 'eth_account', 'eth_utils') if m in sys.modules))")
    env = {**os.environ, "PARALON_DATABASE_URL": f"sqlite:///{tmp_path / 'paralon.db'}"}
    for name in ("PARALON_CRYPTO_SEED", "PARALON_PAYOUT_WALLET_KEY", "PARALON_CRYPTO_TOKENS", "PARALON_PAYOUT_TOKEN"):
        env.pop(name, None)
    loaded = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True, env=env).stdout.splitlines()[-1]
    assert loaded == "[]"


if __name__ == "__main__":
    RECORD.write_text(json.dumps(describe(), indent=1, sort_keys=True) + "\n")
