"""Every command of `paralon`, its arguments, options, defaults, choices and
help text, as recorded in commands.json: a change to the command line shows
here first. After an intended change, write the record again with
`python -m tests.app.cli.test_commands` and read the diff."""
from __future__ import annotations

import json
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


if __name__ == "__main__":
    RECORD.write_text(json.dumps(describe(), indent=1, sort_keys=True) + "\n")
