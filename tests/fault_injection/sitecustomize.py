"""Test-only, never on a production path: tests/test_supervision.py puts this folder on PYTHONPATH,
and Python imports ``sitecustomize`` at start-up in every process (``specdec up`` and the services
it starts). Once the file named by SPECDEC_TEST_ENGINE_FAULT_FILE exists, the verify engine's next
scheduling pass raises (a bug in the loop itself, not in a call), after removing the file, so that
the restarted service runs normally. Inert without the variable; the patch is applied when
``specdec.engine.engine`` is imported, so that processes which never import it (the coordinator) do not
import torch for it."""

import importlib.abc
import os
import sys

FAULT_FILE = os.environ.get("SPECDEC_TEST_ENGINE_FAULT_FILE")


def _patch(engine_module) -> None:
    schedule = engine_module.Engine._schedule

    def failing_schedule(self, alone):
        if self.name == "verify" and os.path.exists(FAULT_FILE):
            os.remove(FAULT_FILE)
            raise RuntimeError("injected by tests/fault_injection: the verify engine's scheduling failed")
        return schedule(self, alone)

    engine_module.Engine._schedule = failing_schedule


def _patch_after(loader) -> None:
    """Has ``loader`` patch the module once it has run it."""
    run = loader.exec_module

    def exec_module(module) -> None:
        run(module)
        _patch(module)

    loader.exec_module = exec_module


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``specdec.engine.engine`` with the other finders and patches it once it has run."""

    def find_spec(self, name, path, target=None):
        if name != "specdec.engine.engine":
            return None
        others = (finder for finder in sys.meta_path if finder is not self)
        spec = next(filter(None, (finder.find_spec(name, path, target) for finder in others)), None)
        if spec is not None:
            _patch_after(spec.loader)
        return spec


if FAULT_FILE:
    sys.meta_path.insert(0, _PatchOnImport())
