"""Test-only, never on a production path: tests/test_supervision.py puts this folder on PYTHONPATH,
and Python imports ``sitecustomize`` at start-up in every process (``specdec up`` and the services
it starts). Once the file named by SPECDEC_TEST_ENGINE_FAULT_FILE exists, the verify engine's next
scheduling pass raises (a bug in the loop itself, not in a call); once the file named by
SPECDEC_TEST_ENGINE_HANG_FILE exists, the verify engine's next step never ends (a forward hung in
the model's library). Either removes its file first, so that the restarted service runs normally.
Inert without the variables; the patch is applied when ``specdec.engine.engine`` is imported, so
that processes which never import it (the coordinator) do not import torch for it."""

import importlib.abc
import os
import sys
import threading

FAULT_FILE = os.environ.get("SPECDEC_TEST_ENGINE_FAULT_FILE")
HANG_FILE = os.environ.get("SPECDEC_TEST_ENGINE_HANG_FILE")


def _armed(path: str | None) -> bool:
    """Whether the file ``path`` exists, removing it if so."""
    if path and os.path.exists(path):
        os.remove(path)
        return True
    return False


def _patch(engine_module) -> None:
    schedule, run_step = engine_module.Engine._schedule, engine_module.Engine._run_step

    def failing_schedule(self, alone):
        if self.name == "verify" and _armed(FAULT_FILE):
            raise RuntimeError("injected by tests/fault_injection: the verify engine's scheduling failed")
        return schedule(self, alone)

    def hanging_step(self, batch, running):
        if self.name == "verify" and _armed(HANG_FILE):
            threading.Event().wait()  # never set: the step never ends
        return run_step(self, batch, running)

    engine_module.Engine._schedule = failing_schedule
    engine_module.Engine._run_step = hanging_step


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


if FAULT_FILE or HANG_FILE:
    sys.meta_path.insert(0, _PatchOnImport())
