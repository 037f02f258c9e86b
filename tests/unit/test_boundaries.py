"""The folder boundaries of docs/architecture.md section 2, checked on every module's imports."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# what sits above the engine and kvtransfer: the workers, the router, the launcher
ABOVE = {"prefill_worker", "decode_worker", "worker_common", "router", "deploy"}
FORBIDDEN = {
    "engine": {"kvtransfer", *ABOVE},
    "kvtransfer": {"engine", *ABOVE},
    "worker_common": {"kvtransfer", "prefill_worker", "decode_worker", "router", "deploy"},
    "prefill_worker": {"decode_worker", "router", "deploy"},
    "decode_worker": {"prefill_worker", "router", "deploy"},
    "router": {"kvtransfer", "prefill_worker", "decode_worker", "worker_common", "deploy"},
    # wire definitions only: the processes' code lives in the folders above
    "protos": {"engine", "kvtransfer", *ABOVE},
}
# the router reaches workers over gRPC only; of the engine it may use the tokenizer side alone.
ALLOWED_ENGINE_MODULES = {
    "router": {"engine.tokenizer", "engine.loader"},
}
# imported by both the engine and kvtransfer: it may import neither, nor anything of the project
LEAF_MODULES = {"kvpool": "kvpool/__init__.py"}


def imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def imported_packages(path: pathlib.Path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path)}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_stay_inside_its_boundary(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no modules"
    bad = [
        f"{f.relative_to(ROOT)} imports {sorted(imported_packages(f) & FORBIDDEN[package])}"
        for f in files
        if imported_packages(f) & FORBIDDEN[package]
    ]
    assert not bad, "boundary violations (see docs/architecture.md section 2):\n" + "\n".join(bad)


@pytest.mark.parametrize("package", sorted(ALLOWED_ENGINE_MODULES))
def test_engine_modules_used_outside_the_workers(package):
    allowed = ALLOWED_ENGINE_MODULES[package]
    bad = [
        f"{f.relative_to(ROOT)} imports {name}"
        for f in sorted((ROOT / package).rglob("*.py"))
        for name in imported_modules(f)
        if name.split(".")[0] == "engine"
        and not any(name == a or name.startswith(a + ".") for a in allowed)
    ]
    assert not bad, f"{package}/ may use only {sorted(allowed)} of the engine:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", sorted(LEAF_MODULES))
def test_engine_modules_lent_out_import_nothing_of_the_engine(module):
    """What is lent out (the router's engine modules, kvpool for the engine and kvtransfer) must
    not pull in the rest of the project."""
    names = imported_packages(ROOT / LEAF_MODULES[module])
    assert not names & ({"engine"} | set(FORBIDDEN)), f"{module} imports {sorted(names)}"
