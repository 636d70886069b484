"""Dependencies point one way: proto -> core -> services -> entry points (issue 17). No services,
no models: a few seconds."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Imports every coordinator module in a fresh interpreter (run from the repository root) and
# prints the heavy packages that came with them.
_IMPORT_COORDINATOR = """
import importlib, pkgutil, sys
import coordinator
for module in pkgutil.walk_packages(coordinator.__path__, "coordinator."):
    importlib.import_module(module.name)
print(" ".join(sorted(name for name in ("torch", "safetensors", "transformers") if name in sys.modules)))
"""


def test_the_coordinator_imports_without_torch():
    # The coordinator only tokenizes. transformers (5.x) imports torch on the way to AutoTokenizer
    # when torch is installed, so loading the tokenizer still does; importing our modules must not.
    done = subprocess.run([sys.executable, "-c", _IMPORT_COORDINATOR], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], f"importing the coordinator's modules imported {done.stdout.strip()}"
