# SPDX-License-Identifier: Apache-2.0
"""Test helper: runs a script in a fresh interpreter, so that a deadlock (the interpreter never
runs Python again), a crash (SIGSEGV) or a runaway allocation fails the test instead of hanging
or killing pytest."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run_isolated(code: str, timeout: float = 120, address_space: Optional[int] = None, common: str = "") -> str:
    """Runs `common` then `code` (each dedented) with this directory and pytest's sys.path
    importable; fails the test on a timeout, a signal or a non-zero exit. `address_space`:
    RLIMIT_AS in bytes, so that an oversized allocation fails quickly rather than exhausting the
    machine. Returns stdout."""
    prelude = ""
    if address_space is not None:
        prelude = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({address_space}, {address_space}))\n"
    prelude += textwrap.dedent(common) + "\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + sys.path), OPENBLAS_NUM_THREADS="1",
               OMP_NUM_THREADS="1")
    try:
        p = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                           timeout=timeout, env=env, cwd=HERE)
    except subprocess.TimeoutExpired as e:  # subprocess.run has killed it
        pytest.fail(f"still running after {timeout} s (deadlock?); stdout: {e.stdout!r}, stderr: {e.stderr!r}")
    if p.returncode != 0:
        how = f"signal {signal.Signals(-p.returncode).name}" if p.returncode < 0 else f"exit {p.returncode}"
        pytest.fail(f"the script failed ({how}); stdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p.stdout
