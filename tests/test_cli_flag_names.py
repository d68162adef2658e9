"""typer 0.27 names an option after its metavar when the metavar is the parameter's name in
capitals (`--DTYPE` for `dtype: ... typer.Option(metavar="DTYPE")`); newer typer does not. Such
an option must name its flag itself, so the CLI has the same flags on every typer it allows."""

from __future__ import annotations

import ast

from tests.server_util import ROOT

FILES = [ROOT / "ftchat" / "cli.py", ROOT / "ftchat" / "cli_options.py"]


def options(tree: ast.AST):
    """(name, typer.Option call): a function parameter's own name, or an alias's (Dtype -> dtype)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            pairs = [(a.arg, a.annotation) for a in node.args.args + node.args.kwonlyargs]
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            pairs = [(node.targets[0].id.lower(), node.value)]
        else:
            continue
        for name, expr in pairs:
            for call in ast.walk(expr) if expr is not None else ():
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                        and call.func.attr == "Option"):
                    yield name, call


def test_options_whose_metavar_is_their_name_declare_their_flag():
    bad, seen = [], 0
    for f in FILES:
        for name, call in options(ast.parse(f.read_text())):
            seen += 1
            declared = any(isinstance(a, ast.Constant) and isinstance(a.value, str)
                           and a.value.startswith("-") for a in call.args)
            metavar = next((k.value.value for k in call.keywords if k.arg == "metavar"
                            and isinstance(k.value, ast.Constant)), None)
            if not declared and metavar == name.upper():
                bad.append(f"{f.name}:{call.lineno} {name} metavar {metavar}")
    assert seen > 20  # the scan finds the CLI's options
    assert not bad, bad
