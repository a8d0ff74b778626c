"""``scripts/researcher_check.py``, written apart from the tests, run as a researcher runs it: Hugging Face RoPE
dicts, grouped-query attention, a padded batch and a key/value cache, each against its own float64 computation."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_researchers_check_passes_every_check():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "researcher_check.py")], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    checks = [line for line in lines if line.startswith(("ok  ", "FAIL"))]
    assert len(checks) >= 10 and all(line.startswith("ok  ") for line in checks), done.stdout
    for what in ("frequencies", "padded batch, grouped-query", "decoding with a KVCache", "unknown rope_type"):
        assert any(what in line for line in checks), what
    assert lines[-1] == "all checks passed"
