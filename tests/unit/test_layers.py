"""The import contracts in pyproject.toml (import-linter) hold: schemas <- libs <- shell <-
services <- bench <- cli, services never import each other, the simulated engine imports no
control-plane code, and pure libs import nothing that does I/O."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is not installed (it is in the dev extra)"
    out = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout
