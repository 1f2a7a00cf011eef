"""The engine stays light and independent: importing it pulls in neither the harness nor HF modeling code."""

from __future__ import annotations

import subprocess
import sys


def test_import_engine_is_light():
    code = ("import sys, engine, engine.core, engine.sample, engine.distributed; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('harness', 'transformers', 'scipy', 'pandas', "
            "'matplotlib', 'tests')]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_engine_never_imports_the_harness():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "engine"
    offenders = [str(p) for p in root.rglob("*.py")
                 if "import harness" in p.read_text() or "from harness" in p.read_text()
                 or "modeling_" in p.read_text()]
    assert not offenders
