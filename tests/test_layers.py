"""The packages' layers, as docs/architecture.md draws them: each module imports only modules of a
lower row of that picture, and lease_server's modules import each other at the top of the file
only (an import inside a function is where a cycle hides)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lease_server", "magics", "jupyter_ext")


def picture() -> dict[str, dict[str, int]]:
    """{package: {module: row}} from the Layers picture of docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    rows: dict[str, dict[str, int]] = {}
    package = ""
    for line in block.splitlines():
        m = re.match(r"^(\w+)/", line)
        if m:
            package = m.group(1)
            line = line[m.end() :]
        row = None
        for word in re.findall(r"[A-Za-z_]+|\d+", line):
            if word.isdigit():
                row = int(word)
            elif row is not None and (ROOT / package / f"{word}.py").exists():
                rows.setdefault(package, {})[word] = row
    return rows


def imports(path: Path, package: str) -> list[tuple[str, bool]]:
    """(sibling module, inside a function) for each import of a module of the same package, leaving
    out those under ``if TYPE_CHECKING:`` (types only: nothing runs)."""
    tree = ast.parse(path.read_text())
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom) and child.level == 1:
                names = [child.module] if child.module else [a.name for a in child.names]
                out.extend((n, nested) for n in names if n and (ROOT / package / f"{n}.py").exists())
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            visit(child, inner)

    visit(tree, False)
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_every_import_points_down_the_picture(package: str) -> None:
    rows = picture()[package]
    modules = sorted(p.stem for p in (ROOT / package).glob("*.py") if p.stem != "__init__")
    assert sorted(rows) == modules, "every module has its row in docs/architecture.md's Layers picture"
    upward = [
        f"{m} (row {rows[m]}) imports {dep} (row {rows[dep]})"
        for m in modules
        for dep, _ in imports(ROOT / package / f"{m}.py", package)
        if rows[dep] >= rows[m]
    ]
    assert upward == []


def test_lease_server_imports_nothing_of_its_own_inside_a_function() -> None:
    inside = [
        f"{p.stem} imports {dep} in a function"
        for p in sorted((ROOT / "lease_server").glob("*.py"))
        for dep, nested in imports(p, "lease_server")
        if nested
    ]
    assert inside == []
