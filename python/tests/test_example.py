# SPDX-License-Identifier: Apache-2.0
"""The Python engine example runs and its sequences stay within the admission bound."""
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "python" / "vllm_style.py"


def test_vllm_style_example():
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "120"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "rounds evicted" in out.stdout and "admitted 6 of 6" in out.stdout
