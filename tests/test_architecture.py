"""Which package may import which (README, "Architecture"): federation → replica → kernels, never
upward; loadtest and bench sit above the serving packages, cli above everything. Checked over
every import statement, lazy ones inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "replica", "federation", "loadtest", "bench", "cli")
MAY_IMPORT = {
    "kernels": {"kernels"},
    "replica": {"replica", "kernels"},
    "federation": {"federation", "replica", "kernels"},
    "loadtest": {"loadtest", "federation"},  # a client; starts federations for comparisons
    "bench": {"bench", "federation", "replica", "kernels", "loadtest"},
    "cli": set(PACKAGES),
}


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            found.add(str(node.args[0].value).split(".")[0])  # importlib, spelled out
    return found & set(PACKAGES)


def test_every_import_follows_the_layers():
    wrong = []
    for package, allowed in MAY_IMPORT.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for target in imports_of(path) - allowed:
                wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_rules_cover_every_package():
    assert set(MAY_IMPORT) == set(PACKAGES)
    assert all((ROOT / p / "__init__.py").exists() for p in PACKAGES)
