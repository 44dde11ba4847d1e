"""`paralon`: the operator's command line. Every command takes --json; money
fields are integers with the unit in the key.

One module per part of the system. A command's module is imported only when
that command runs: the modules together import web3, WeasyPrint, Celery and
Litestar, about two seconds that `paralon balance` should not wait for."""
from __future__ import annotations

import importlib

import click

# The module of each top-level command (each module's COMMANDS).
COMMAND_MODULES = {
    "app.cli.accounts": ("accounts", "tokens", "activity"),
    "app.cli.billing": ("invoices", "statements", "projections"),
    "app.cli.database": ("db",),
    "app.cli.dev": ("up", "demo"),
    "app.cli.ledger": ("migrate", "credits", "balance", "ledger", "holds"),
    "app.cli.members": ("members",),
    "app.cli.payments": ("stripe", "crypto"),
    "app.cli.payouts": ("payouts",),
    "app.cli.platform": ("platform",),
    "app.cli.proxy": ("keys", "models", "workers", "sim-worker"),
    "app.cli.servers": ("serve", "worker", "beat"),
}
MODULE_OF_COMMAND = {name: module for module, names in COMMAND_MODULES.items() for name in names}


class CommandsByModule(click.Group):
    """A group whose commands are loaded from their module when first asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(MODULE_OF_COMMAND)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in MODULE_OF_COMMAND:
            return None
        module = importlib.import_module(MODULE_OF_COMMAND[name])
        return {command.name: command for command in module.COMMANDS}[name]


@click.group(cls=CommandsByModule)
def main() -> None:
    """Paralon: the money and traffic layer of a GPU inference network."""
