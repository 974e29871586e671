"""Which names a cell reads from the notebook and which it assigns, from its syntax tree."""

from __future__ import annotations

import ast
import builtins
import types
from dataclasses import dataclass, field
from typing import Any

# Names IPython puts in every namespace; they never travel to the worker.
_IPYTHON_NAMES = {
    "In",
    "Out",
    "get_ipython",
    "exit",
    "quit",
    "_",
    "__",
    "___",
    "_ih",
    "_oh",
    "_dh",
    "_i",
    "_ii",
    "_iii",
}


@dataclass
class CellPlan:
    body: str
    last_expr: str | None
    reads: set[str] = field(default_factory=set)
    assigns: list[str] = field(default_factory=list)


class _Scan(ast.NodeVisitor):
    def __init__(self) -> None:
        self.reads: set[str] = set()
        self.assigns: list[str] = []

    def _assign(self, name: str) -> None:
        if name not in self.assigns:
            self.assigns.append(name)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.reads.add(node.id)
        else:
            self._assign(node.id)

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        for alias in node.names:
            self._assign((alias.asname or alias.name).split(".")[0])

    visit_ImportFrom = visit_Import  # noqa: N815

    def _scope(self, node: ast.AST, name: str | None) -> None:
        if name:
            self._assign(name)
        # Names read inside functions and classes still travel; names they assign stay local.
        inner = _Scan()
        for child in ast.iter_child_nodes(node):
            inner.visit(child)
        self.reads |= inner.reads

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._scope(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scope(node, node.name)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._scope(node, None)

    def _comprehension(self, node: ast.AST) -> None:
        self._scope(node, None)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension  # noqa: N815

    def visit_Global(self, node: ast.Global) -> None:
        for name in node.names:
            self._assign(name)


def plan_cell(source: str) -> CellPlan:
    """Split off the last expression (its value is the cell's result) and scan names."""
    tree = ast.parse(source, "<gpu_train cell>")
    scan = _Scan()
    scan.visit(tree)
    body, last_expr = source, None
    last = tree.body[-1] if tree.body else None
    if isinstance(last, ast.Expr) and last.col_offset == 0:
        # Keep the original lines (and so the line numbers of tracebacks): the body is every line
        # before the last expression, which is padded with newlines to keep its own line number.
        lines = source.splitlines(True)
        body = "".join(lines[: last.lineno - 1])
        last_expr = "\n" * (last.lineno - 1) + "".join(lines[last.lineno - 1 :]).strip()
    return CellPlan(body=body, last_expr=last_expr, reads=scan.reads, assigns=scan.assigns)


def pick_inputs(reads: set[str], user_ns: dict[str, Any]) -> dict[str, Any]:
    """The values of the names the cell reads that the notebook defines (not builtins)."""
    return {
        n: user_ns[n]
        for n in sorted(reads)
        if n in user_ns
        and n not in _IPYTHON_NAMES
        and not (hasattr(builtins, n) and user_ns[n] is getattr(builtins, n))
    }


def pick_outputs(assigns: list[str]) -> list[str]:
    """Names that come back to the notebook: what the cell assigns, but not private names."""
    return [n for n in assigns if not n.startswith("_")]


def is_module(value: object) -> bool:
    return isinstance(value, types.ModuleType)
