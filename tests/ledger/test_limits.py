"""Every number of the core is named once: in ledger/limits.py, or in money.py's unit definitions."""
from __future__ import annotations

import ast
from pathlib import Path

import ledger
from ledger import limits

LEDGER_DIR = Path(ledger.__file__).parent
NAMED_HERE = {"limits.py", "money.py"}  # money.py defines the unit (nano-USD per USD, per cent) and the owner's share
TRIVIAL = {0, 1}  # empty, first, one more: not limits


def _numbers(tree: ast.AST) -> list[ast.Constant]:
    """Numeric literals, leaving out positions inside a tuple or a row (`row[3]`, `row[:3]`)."""
    positions = {id(node.slice) for node in ast.walk(tree) if isinstance(node, ast.Subscript)}
    positions |= {id(part) for node in ast.walk(tree) if isinstance(node, ast.Slice)
                  for part in (node.lower, node.upper, node.step) if part is not None}
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and type(node.value) in (int, float) and id(node) not in positions]


def test_no_number_is_written_outside_the_modules_that_name_them():
    stray = []
    for path in sorted(LEDGER_DIR.rglob("*.py")):
        if path.relative_to(LEDGER_DIR).as_posix() in NAMED_HERE:
            continue
        stray += [f"{path.relative_to(LEDGER_DIR)}:{node.lineno}: {node.value!r}"
                  for node in _numbers(ast.parse(path.read_text())) if node.value not in TRIVIAL]
    assert stray == [], "name these in ledger/limits.py"


def test_each_limit_is_named_once():
    tree = ast.parse(Path(limits.__file__).read_text())
    names = [target.id for node in tree.body if isinstance(node, ast.Assign) for target in node.targets]
    assert sorted(names) == sorted(set(names))
