"""Run Triton kernels on the CPU in a child process under ``TRITON_INTERPRET=1``.

Triton fixes a kernel's mode (interpreted or compiled) when the kernel is decorated, at import,
and the variable is process-wide: setting it in the pytest process would silently switch every
other test of the suite (GPU tests included) to the interpreter. So each interpreter check runs
in a fresh Python started from the repository root, with the repository and ``tests/`` on
``PYTHONPATH`` (the child imports this checkout's turbo_moe and the test helpers).

Two kinds of child:

* a check script (``python -c CODE``) that asserts and prints ``ok`` as its last line:
  :func:`assert_prints_ok`; the same script runs compiled on a GPU through :func:`run_on_gpu`;
* a worker that prints ``RESULTS_JSON {...}`` (one result per case): :func:`results_json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_interpreted(args, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python *args`` under ``TRITON_INTERPRET=1`` from the repository root (skips without triton)."""
    pytest.importorskip("triton")
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=ROOT)


def assert_prints_ok(code: str, timeout: int = 600) -> None:
    """Run the check script ``code`` interpreted; it must exit 0 with ``ok`` as its last line."""
    proc = run_interpreted(["-c", code], timeout)
    last = proc.stdout.strip().splitlines()[-1:]
    assert proc.returncode == 0 and last == ["ok"], proc.stdout[-2000:] + proc.stderr[-3000:]


def run_on_gpu(code: str, name: str) -> None:
    """Run the check script ``code`` in this process (compiled kernels: a GPU test)."""
    pytest.importorskip("triton")
    exec(compile(code, name, "exec"), {})


def results_json(args, timeout: int = 600) -> dict:
    """Run the worker ``python *args`` interpreted and return its last ``RESULTS_JSON`` line, parsed;
    the test fails with the worker's stderr if it exits non-zero or prints none."""
    proc = run_interpreted(args, timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS_JSON ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"interpreter child failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULTS_JSON "):])
