"""The packages' layers, as docs/architecture.md draws them (and docs/gpu_train.md for magics/):
each module imports only modules of a lower row of that picture, the rows go down lease_server's
layer folders in order (so a module's folder says what it may import), lease_server's modules
import each other at the top of the file only (an import inside a function is where a cycle
hides), and magics/ has no import circle even counting imports for types only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lease_server", "magics", "jupyter_ext")
ON_TOP = ("cli", "sim")  # lease_server's command and simulator: they may import all of it


def picture() -> dict[str, dict[str, int]]:
    """{package: {module: row}} from the Layers pictures of docs/architecture.md and
    docs/gpu_train.md; a module is named by its dotted path inside its package ("store.keys")."""
    block = ""
    for doc in ("architecture.md", "gpu_train.md"):
        text = (ROOT / "docs" / doc).read_text()
        block += text.split("## Layers", 1)[1].split("```", 2)[1]
    rows: dict[str, dict[str, int]] = {}
    folder = ""
    for line in block.splitlines():
        m = re.match(r"^([\w/]+)/", line)
        if m:
            folder = m.group(1)
            line = line[m.end() :]
        package, _, sub = folder.partition("/")
        row = None
        for word in re.findall(r"[A-Za-z_]+|\d+", line):
            if word.isdigit():
                row = int(word)
            elif row is not None and (ROOT / folder / f"{word}.py").exists():
                rows.setdefault(package, {})[f"{sub}.{word}".replace("/", ".").lstrip(".")] = row
    return rows


def modules(package: str) -> list[str]:
    """The package's modules as dotted paths inside it, cli/ and sim/ left out."""
    out = []
    files = (ROOT / package).rglob("*.py") if package == "lease_server" else (ROOT / package).glob("*.py")
    for p in sorted(files):
        rel = p.relative_to(ROOT / package)
        if p.stem == "__init__" or rel.parts[0] in ON_TOP or "labextension" in rel.parts:
            continue
        out.append(".".join(rel.with_suffix("").parts))
    return out


def imports(package: str, module: str, types: bool = False) -> list[tuple[str, bool]]:
    """(module of the same package, inside a function) for each import of one, leaving out those
    under ``if TYPE_CHECKING:`` (types only: nothing runs) unless ``types``."""
    here = module.split(".")[:-1]
    tree = ast.parse((ROOT / package / Path(*module.split("."))).with_suffix(".py").read_text())
    out: list[tuple[str, bool]] = []

    def named(dotted: list[str]) -> str | None:
        path = ROOT / package / Path(*dotted) if dotted else None
        return ".".join(dotted) if path is not None and path.with_suffix(".py").exists() else None

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and not types:
                continue
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = here[: len(here) - (child.level - 1)]
                elif (child.module or "").split(".")[0] == package:
                    base, child_module = [], child.module.split(".", 1)[1] if "." in child.module else ""
                    base = child_module.split(".") if child_module else []
                else:
                    base = None
                if base is not None:
                    stem = base + (child.module.split(".") if child.level and child.module else [])
                    found = [named(stem)] + [named([*stem, a.name]) for a in child.names]
                    out.extend((n, nested) for n in found if n)
            visit(child, nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_every_import_points_down_the_picture(package: str) -> None:
    rows = picture()[package]
    assert sorted(rows) == modules(package), "every module has its row in docs/architecture.md's Layers picture"
    upward = [
        f"{m} (row {rows[m]}) imports {dep} (row {rows[dep]})"
        for m in modules(package)
        for dep, _ in imports(package, m, types=package == "magics")
        if rows[dep] >= rows[m]
    ]
    assert upward == []


def test_the_rows_go_down_the_layer_folders_in_order() -> None:
    """Every row of a folder lies below every row of the folders listed before it: a module then
    imports nothing of a folder after its own."""
    rows = picture()["lease_server"]
    folders = list(dict.fromkeys(m.rpartition(".")[0] for m in rows))
    assert folders == ["", "store", "leasing", "node", "web"]
    spans = [[r for m, r in rows.items() if m.rpartition(".")[0] == f] for f in folders]
    assert all(max(a) < min(b) for a, b in zip(spans, spans[1:], strict=False))
    assert sorted(
        p.name for p in (ROOT / "lease_server").iterdir() if p.is_dir() and p.name != "__pycache__"
    ) == sorted([*folders[1:], *ON_TOP])


def test_lease_server_imports_nothing_of_its_own_inside_a_function() -> None:
    inside = [
        f"{m} imports {dep} in a function"
        for m in modules("lease_server")
        for dep, nested in imports("lease_server", m)
        if nested
    ]
    assert inside == []
