"""The numbers a package writes outside its limits.py, for the tests that every
limit is named once, with its unit, in the package's limits.py.

Not counted: 0 and 1 (empty, first, one more); a position in a row (`row[3]`);
an HTTP status given to something named for one (`status=`, `status_code`, a
parameter `status`, compared with a status); a port given to something named
for one (`DEFAULT_PORT`). A module-level constant is counted even when it is 0
or 1: a named limit belongs in limits.py."""
from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from http import HTTPStatus
from pathlib import Path

TRIVIAL = {0, 1}
HTTP_STATUSES = {int(status) for status in HTTPStatus if status >= HTTPStatus.OK}
# Nodes a number passes through on its way to what it is given to: `(8101, 8102)`, `{"http": 80}`, `-2`, `24 * 3600`.
CARRIERS = (ast.Tuple, ast.List, ast.Set, ast.Dict, ast.UnaryOp, ast.BinOp)


def stray_numbers(package_dir: Path, data_files: dict[str, str]) -> list[str]:
    """`path:line: value` of each number written outside limits.py and the
    files of data (path relative to the package -> why it is data)."""
    trees = {path.relative_to(package_dir).as_posix(): ast.parse(path.read_text())
             for path in sorted(package_dir.rglob("*.py"))}
    parameters = {name: names for tree in trees.values() for name, names in _parameter_names(tree).items()}
    return [f"{relative}:{node.lineno}: {node.value!r}" for relative, tree in trees.items()
            if relative != "limits.py" and relative not in data_files
            for node in _limit_numbers(tree, parameters)]


def assigned_names(path: Path) -> list[str]:
    """The names a module binds at its top level with `=` (imports not included)."""
    if not path.exists():
        return []
    tree = ast.parse(path.read_text())
    return [target.id for node in tree.body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)]


def _limit_numbers(tree: ast.Module, parameters: dict[str, list[str]]) -> Iterator[ast.Constant]:
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    module_constants = {id(node.value) for node in tree.body
                        if isinstance(node, ast.Assign) and any(_is_constant_name(t) for t in node.targets)}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and type(node.value) in (int, float)):
            continue
        if _is_status_or_port(node, _given_to(node, parents, parameters)):
            continue
        if id(node) in module_constants or not (node.value in TRIVIAL or _is_row_position(node, parents)):
            yield node


def _is_constant_name(target: ast.expr) -> bool:
    return isinstance(target, ast.Name) and target.id.isupper()


def _is_row_position(node: ast.AST, parents: dict) -> bool:
    parent = parents.get(node)
    return isinstance(parent, ast.Subscript) and parent.slice is node


def _is_status_or_port(node: ast.Constant, names: list[str]) -> bool:
    words = set(re.split(r"[^a-z0-9]+", " ".join(names).lower()))  # smtp_port, --worker-ports, exc.status_code
    return (node.value in HTTP_STATUSES and "status" in words) or not words.isdisjoint({"port", "ports"})


def _given_to(node: ast.AST, parents: dict, parameters: dict[str, list[str]]) -> list[str]:
    """The names of what a number is given to: a variable, a keyword, a
    parameter, a dictionary key, the other side of a comparison."""
    names: list[str] = []
    chain, parent = [node], parents.get(node)
    while isinstance(parent, CARRIERS):
        if isinstance(parent, ast.Dict) and chain[-1] in parent.values:
            key = parent.keys[parent.values.index(chain[-1])]
            names.append(key.value if isinstance(key, ast.Constant) else "")
        chain.append(parent)
        parent = parents.get(parent)
    child = chain[-1]
    if isinstance(parent, ast.keyword):
        names.append(parent.arg or "")
        parent = parents.get(parent)  # click.option("--port", default=...): the option's name too
    if isinstance(parent, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
        names += [_target_name(target, chain) for target in targets]
    elif isinstance(parent, ast.Compare):
        names += [ast.unparse(side) for side in (parent.left, *parent.comparators) if side is not child]
    elif isinstance(parent, ast.arguments):
        names.append(_parameter_of_default(parent, child))
    elif isinstance(parent, ast.Call):
        names += _call_names(parent, child, parameters)
    return names


def _target_name(target: ast.expr, chain: list[ast.AST]) -> str:
    """`status, kind = 404, "x"`: the name the number lands in, not its neighbours'."""
    value = chain[-1]
    if (isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(chain) > 1
            and len(target.elts) == len(value.elts)):
        return ast.unparse(target.elts[value.elts.index(chain[-2])])
    return ast.unparse(target)


def _parameter_of_default(arguments: ast.arguments, default: ast.AST) -> str:
    positional = [*arguments.posonlyargs, *arguments.args]
    pairs = list(zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults))
    pairs += [(arg, d) for arg, d in zip(arguments.kwonlyargs, arguments.kw_defaults) if d is not None]
    return next((arg.arg for arg, d in pairs if d is default), "")


def _call_names(call: ast.Call, argument: ast.AST, parameters: dict[str, list[str]]) -> list[str]:
    """The called function's name, its string arguments (an option's name) and,
    for a function of this package, the parameter the number is given to."""
    callee = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    names = [callee] + [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    if argument in call.args and call.args.index(argument) < len(parameters.get(callee, [])):
        names.append(parameters[callee][call.args.index(argument)])
    return names


def _parameter_names(tree: ast.Module) -> dict[str, list[str]]:
    """Positional parameters of the functions and classes a module defines (`HttpError(404, ...)` -> status)."""
    found: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
        elif isinstance(node, ast.ClassDef):
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            if init is not None:
                found[node.name] = [a.arg for a in init.args.args[1:]]
    return found
