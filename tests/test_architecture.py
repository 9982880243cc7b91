"""Which package may import which (README, "Architecture"): federation → replica → kernels, never
upward; loadtest and bench sit above the serving packages, cli above everything. Checked over
every import statement, lazy ones inside functions included. And which modules may read the
environment (DESIGN.md, "Configuration": in one place)."""

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


# The command line reads fedserve's configuration from the environment and passes it down.
# The one exception: the C toolchain's conventions (CC, XDG_CACHE_HOME) where the CPU kernels
# are compiled, lazily, in whichever process (a Ray replica, say) first needs them.
READS_ENVIRONMENT = {"cli/main.py", "kernels/cpu.py"}
_ENVIRONMENT = {"environ", "environb", "getenv", "getenvb"}


def environment_reads(source: str) -> list[int]:
    """Lines that read the process environment: os.getenv, or os.environ other than as the
    target of an assignment (setting a variable for the processes one starts reads nothing)."""
    tree = ast.parse(source)
    targets = {id(n.value) for n in ast.walk(tree)
               if isinstance(n, ast.Subscript) and isinstance(n.ctx, (ast.Store, ast.Del))}
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in _ENVIRONMENT
                and isinstance(node.value, ast.Name) and node.value.id == "os"
                and id(node) not in targets):
            lines.append(node.lineno)
        elif (isinstance(node, ast.ImportFrom) and node.module == "os"
              and {a.name for a in node.names} & _ENVIRONMENT):
            lines.append(node.lineno)
    return sorted(lines)


def test_environment_reads_are_found():
    assert environment_reads("import os\nx = os.environ.get('A')\ny = os.getenv('B')") == [2, 3]
    assert environment_reads("import os\nos.environ.setdefault('A', '1')") == [2]
    assert environment_reads("from os import environ") == [1]
    assert environment_reads("import os\nos.environ['A'] = '0'") == []


def test_only_the_command_line_reads_the_environment():
    wrong, reading = [], set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            lines = environment_reads(path.read_text())
            if lines:
                reading.add(name)
            if lines and name not in READS_ENVIRONMENT:
                wrong.append(f"{name} reads the environment (line {', '.join(map(str, lines))})")
    assert not wrong, "\n".join(wrong)
    assert reading == READS_ENVIRONMENT, "an allowed module no longer reads it: drop it from the list"


def test_no_test_module_collected_before_the_interpreter_tests_imports_triton():
    """tests/kernels/test_triton_kernels.py must import Triton first in its process (it sets
    TRITON_INTERPRET=1, or skips the whole file): an xdist worker collects every test module,
    in path order, so none collected before it may import Triton at module level."""
    import subprocess
    import sys

    first = ROOT / "tests" / "kernels" / "test_triton_kernels.py"
    before = [p for p in sorted((ROOT / "tests").rglob("test_*.py"))
              if str(p) < str(first) and p.name not in ("test_gpu.py", "test_cuda.py")]
    mods = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in before]
    code = ("import importlib, sys\nfor m in %r:\n    importlib.import_module(m)\n"
            "print([m for m in sys.modules if m == 'triton'])") % (mods,)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]"], "a test module imports triton before the interpreter tests"
