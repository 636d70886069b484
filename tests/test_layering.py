"""Dependencies point one way: the proto (``specdec.v1``), then the core (``specdec``),
then the services (``coordinator``, ``draft_service``, ``verify_service``), then the command
(``specdec_app``). Read from the source with :mod:`ast`, every import counts, at module level or
inside a function, except those under ``if TYPE_CHECKING:``. No services, no models: a few seconds."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTO, CORE, SERVICE, APP = "proto", "core", "service", "app"
SERVICES = ("coordinator", "draft_service", "verify_service")
LAYERS = (PROTO, CORE, SERVICE, APP)
# Modules allowed to import a later layer, with the reason.
UPWARD_ALLOWED = {
    "specdec.__main__": "keeps `python -m specdec` running the command; nothing imports a __main__ module",
}


def layer(module: str) -> str | None:
    """The layer of one of our modules; None for a module of another project."""
    top = module.split(".")[0]
    if module == "specdec.v1" or module.startswith("specdec.v1."):
        return PROTO
    return {"specdec": CORE, "specdec_app": APP, **dict.fromkeys(SERVICES, SERVICE)}.get(top)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module ``module``'s source imports (for ``from a import b``: ``a``, and ``a.b`` in case
    it is a module), lazily or not, leaving out what it imports only for type checkers."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def _our_modules() -> dict[str, set[str]]:
    """Each of our modules (generated stubs included, when built) -> the modules it imports."""
    modules = {}
    for top in ("specdec", *SERVICES, "specdec_app"):
        for path in sorted((ROOT / top).rglob("*.py")):
            name = _module_name(path)
            modules[name] = imports(path.read_text(), name, path.name == "__init__.py")
    return modules


MODULES = _our_modules()


def _ours(imported: str) -> str | None:
    """The module of ours that ``imported`` names (``a.b`` of ``from a import b`` may be a
    function, then it is ``a``); None for another project's."""
    while imported and imported not in MODULES:
        imported = imported.rpartition(".")[0]
    return imported or None


def _edges(module: str, packages: bool = False) -> set[str]:
    """Our modules that ``module`` imports; ``packages``: with the packages they are in, whose
    ``__init__`` runs first (``specdec`` for ``specdec.v1``: not a dependency between layers)."""
    out = set()
    for imported in MODULES[module]:
        target = _ours(imported)
        while target:
            out.add(target)
            target = target.rpartition(".")[0] if packages and "." in target else None
    return out - {module}


def test_the_import_reader_sees_lazy_imports_and_skips_type_checking_ones():
    source = (
        "from typing import TYPE_CHECKING\nimport grpc\nfrom specdec.rpc import tls\n"
        "if TYPE_CHECKING:\n    from specdec.engine.engine import EngineMetrics\n"
        "def f():\n    from coordinator.api.client import stream\n    import torch\n"
    )
    found = imports(source, "specdec.example")
    assert {"grpc", "specdec.rpc", "specdec.rpc.tls", "coordinator.api.client", "torch"} <= found
    assert not {name for name in found if name.startswith("specdec.engine.engine")}
    assert imports("from . import ngram\nfrom .contract import Drafter\n", "draft_service.drafters.suffix") >= {
        "draft_service.drafters.ngram",
        "draft_service.drafters.contract",
    }


def test_the_layers_are_found():
    assert {layer(name) for name in MODULES} >= {CORE, SERVICE, APP}
    assert "specdec_app.cli" in MODULES and "coordinator.speculation.upstream" in MODULES


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_later_layer_or_another_service(module):
    if module in UPWARD_ALLOWED:
        return
    own = layer(module)
    bad = []
    for target in sorted(_edges(module)):
        other = layer(target)
        if LAYERS.index(other) > LAYERS.index(own):
            bad.append(f"{target} (layer {other})")
        elif own == other == SERVICE and target.split(".")[0] != module.split(".")[0]:
            bad.append(f"{target} (another service)")
    assert not bad, (
        f"{module} (layer {own}) imports {', '.join(bad)}: dependencies point proto -> core -> services -> "
        "specdec_app. Move what both sides need into the lower layer (a service's helper that the core or "
        "another service needs goes into specdec/), or move the importing code up."
    )


def _reachable(start: str) -> dict[str, str]:
    """Our modules that importing ``start`` may import (lazy imports included), each with the
    module that imports it first."""
    seen, todo = {start: ""}, [start]
    while todo:
        module = todo.pop()
        for target in sorted(_edges(module, packages=True)):
            if target not in seen:
                seen[target] = module
                todo.append(target)
    return seen


def _chain(parents: dict[str, str], module: str) -> str:
    chain = [module]
    while parents[chain[-1]]:
        chain.append(parents[chain[-1]])
    return " <- ".join(chain)


@pytest.mark.parametrize("module", sorted(name for name in MODULES if name.split(".")[0] == "coordinator"))
def test_the_coordinator_needs_no_torch(module):
    parents = _reachable(module)
    bad = [
        _chain(parents, name)
        for name in sorted(parents)
        if any(
            imported == "torch" or imported.startswith("torch.") or imported == "safetensors.torch"
            for imported in MODULES[name]
        )
    ]
    assert not bad, (
        f"importing {module} can import torch through {'; '.join(bad)}. The coordinator only tokenizes: "
        "put the torch-free part (plain Python, numpy, protos) in a core module without torch "
        "(as specdec/sampling/sampling_params.py, token_ids.py, model_files.py)."
    )


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
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_COORDINATOR], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], f"importing the coordinator's modules imported {done.stdout.strip()}"


# Within the coordinator: (importing part, imported part, why not). The round's input types live in
# speculation/plan.py (validation in api/ builds them), and the Prometheus exporter reads placement
# through a protocol of its own (observability/prometheus.py), so neither arrow is needed.
FORBIDDEN_WITHIN_COORDINATOR = (
    ("coordinator.speculation", "coordinator.api", "the round reads its input from speculation/plan.py"),
    ("coordinator.observability", "coordinator.speculation", "the exporters read what speculation hands them"),
)


@pytest.mark.parametrize(("importer", "imported", "why"), FORBIDDEN_WITHIN_COORDINATOR)
def test_the_coordinators_parts_import_one_way(importer, imported, why):
    bad = [
        f"{module} imports {target}"
        for module in sorted(MODULES)
        if module == importer or module.startswith(f"{importer}.")
        for target in sorted(_edges(module))
        if target == imported or target.startswith(f"{imported}.")
    ]
    assert not bad, f"{'; '.join(bad)}: {importer} must not import {imported} ({why})"
