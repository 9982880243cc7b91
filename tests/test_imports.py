"""Importing the serving packages must not import Triton: a process that imported it without
TRITON_INTERPRET=1 can no longer interpret kernels, and the interpreter tests of
tests/kernels/test_triton_kernels.py would be skipped in the full suite without anyone noticing."""

from __future__ import annotations

import subprocess
import sys

MODULES = ["replica", "replica.server", "replica.wire", "kernels.ops", "kernels.prefill",
           "federation.app", "federation.ingress", "federation.router", "cli.main"]


def test_serving_modules_do_not_import_triton():
    code = (f"import sys\nfor m in {MODULES!r}:\n    __import__(m)\n"
            "    assert 'triton' not in sys.modules, m\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
