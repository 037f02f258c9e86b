"""The folder boundaries of docs/architecture.md section 2, checked on every module's imports.

Every folder installs as `pdserve.<folder>`; `package_of` reads an import by its folder
("pdserve.engine.tokenizer" is in `engine`). The last tests check the namespace itself: every
import of the project is spelled `pdserve.*`, pyproject's package list covers every folder
that holds modules, and benchmarks/ and experiments/ import the package as users do."""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# what sits above the engine and kvtransfer: the workers, the router, the launcher
ABOVE = {
    "prefill_worker",
    "decode_worker",
    "worker_common",
    "router",
    "deploy",
    "tuning",
    "planner",
}
FORBIDDEN = {
    "engine": {"kvtransfer", *ABOVE},
    "kvtransfer": {"engine", *ABOVE},
    "worker_common": {
        "kvtransfer",
        "prefill_worker",
        "decode_worker",
        "router",
        "deploy",
        "tuning",
    },
    "prefill_worker": {"decode_worker", "router", "deploy", "tuning"},
    "decode_worker": {"prefill_worker", "router", "deploy", "tuning"},
    "router": {
        "kvtransfer",
        "prefill_worker",
        "decode_worker",
        "worker_common",
        "deploy",
        "tuning",
    },
    # the tuner reaches the planner's policy through pdserve.planner, never through the router
    "tuning": {"router"},
    # the policy and its loops: the router and the tuner import it, it imports neither
    # pure policy over numbers: nothing of the project below or beside it either
    "planner": {"engine", "kvtransfer", *ABOVE} - {"planner"},
    # the launcher runs what the tuner wrote; it never needs the tuner
    "deploy": {"tuning"},
    # wire definitions only: the processes' code lives in the folders above
    "protos": {"engine", "kvtransfer", *ABOVE},
}
# the router reaches workers over gRPC only; of the engine it may use the tokenizer side alone.
ALLOWED_ENGINE_MODULES = {
    "router": {
        "pdserve.engine.tokenizer",
        "pdserve.engine.loader",
        "pdserve.engine.beam_search",
        "pdserve.engine.chat_content",
        "pdserve.engine.image_keys",
    },
}
# imported by both the engine and kvtransfer (kvpool), or by the engine and the router (beam
# search's algorithm, a chat template's content format, images' cache keys): each may import
# nothing of the project
LEAF_MODULES = {
    "kvpool": "kvpool/__init__.py",
    "beam_search": "engine/beam_search.py",
    "chat_content": "engine/chat_content.py",
    "image_keys": "engine/image_keys.py",
}


@functools.cache
def parsed(path: pathlib.Path) -> ast.Module:
    """A file's syntax tree, parsed once for all the tests of this module (they only read it)."""
    return ast.parse(path.read_text(), filename=str(path))


@functools.cache
def imported_modules(path: pathlib.Path) -> frozenset[str]:
    tree = parsed(path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return frozenset(names)


def package_of(name: str) -> str:
    """The repository folder an absolute import names: "pdserve.router.pool" -> "router"."""
    parts = name.split(".")
    return parts[1] if parts[0] == "pdserve" and len(parts) > 1 else parts[0]


def imported_packages(path: pathlib.Path) -> set[str]:
    return {package_of(name) for name in imported_modules(path)}


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
        if package_of(name) == "engine"
        and not any(name == a or name.startswith(a + ".") for a in allowed)
    ]
    assert not bad, f"{package}/ may use only {sorted(allowed)} of the engine:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", sorted(LEAF_MODULES))
def test_engine_modules_lent_out_import_nothing_of_the_engine(module):
    """What is lent out (the router's engine modules, kvpool for the engine and kvtransfer) must
    not pull in the rest of the project."""
    names = imported_packages(ROOT / LEAF_MODULES[module])
    assert not names & ({"engine"} | set(FORBIDDEN)), f"{module} imports {sorted(names)}"


@pytest.mark.parametrize("package", ["router", "tuning"])
def test_the_router_and_the_tuner_reach_the_planner_through_its_own_package(package):
    """Both run the same policy (the live loop's actuator is in router/, the simulated one's in
    tuning/); neither imports the other (FORBIDDEN)."""
    users = [f for f in sorted((ROOT / package).rglob("*.py")) if "planner" in imported_packages(f)]
    assert users, f"{package}/ no longer imports pdserve.planner"


# The repository's folders that install as pdserve.<folder>, and those that never install.
INSTALLED = {"pdserve", *FORBIDDEN, *ABOVE, "kvpool"}
NOT_INSTALLED = {"benchmarks", "experiments", "tests"}


def python_files(*folders: str) -> list[pathlib.Path]:
    return sorted(f for d in folders for f in (ROOT / d).rglob("*.py"))


def test_every_import_of_the_project_is_spelled_pdserve_dot():
    """A bare `import engine` works in a checkout (the root is on sys.path) and fails in the
    installed wheel; and one module imported under two names is two modules. (Only the files
    whose text has an import of such a name are parsed: the tests, benchmarks and experiments
    are parsed for nothing else, and parsing them all was a third of this module's time.)"""
    bare = INSTALLED - {"pdserve"}
    names = "|".join(sorted(bare))
    maybe = re.compile(rf"^[ \t]*(from[ \t]+({names})\b|import[ \t].*\b({names})\b)", re.M)
    bad = [
        f"{f.relative_to(ROOT)} imports {name}"
        for f in python_files(*INSTALLED, *NOT_INSTALLED)
        if maybe.search(f.read_text())
        for name in imported_modules(f)
        if name.split(".")[0] in bare
    ]
    assert not bad, "import these as pdserve.<folder>:\n" + "\n".join(bad)


def test_modules_imported_by_name_are_spelled_pdserve_dot_too():
    """importlib.import_module with a string: the check above cannot see it. A backend module
    named "kvtransfer.backends..." stopped every decode worker started outside a checkout."""
    bare = INSTALLED - {"pdserve"}
    bad = []
    for f in python_files(*INSTALLED):
        for node in ast.walk(parsed(f)):
            if not (
                isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
            ):
                continue
            arg = node.args[0] if node.args else None
            parts = arg.values if isinstance(arg, ast.JoinedStr) else [arg]
            first = parts[0] if parts else None
            if isinstance(first, ast.Constant) and str(first.value).split(".")[0] in bare:
                bad.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "spell these pdserve.<folder>... or build them from __name__:\n" + "\n".join(
        bad
    )


def test_pyproject_installs_every_folder_that_holds_modules():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = config["package-dir"]
    assert {f"pdserve.{d}" for d in INSTALLED - {"pdserve"}} | {"pdserve"} == set(mapping)
    expected = set()
    for name, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            expected.add(".".join((name, *rel)))
    assert set(config["packages"]) == expected
    assert not any(d in NOT_INSTALLED for d in mapping.values())


@pytest.mark.parametrize("folder", ["benchmarks", "experiments"])
def test_benchmarks_and_experiments_import_the_package_without_editing_sys_path(folder):
    files = python_files(folder)
    assert files
    bad = []
    for f in files:
        tree = parsed(f)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path":
                if isinstance(node.value, ast.Name) and node.value.id == "sys":
                    bad.append(f"{f.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if "sys.path" in node.value:  # code handed to a child process
                    bad.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "run these as `python -m <folder>.<name>` from the root instead:\n" + "\n".join(
        bad
    )


def test_no_test_module_imports_conftest_or_another_test_module():
    """Plain helpers are the package tests/helpers/ and fixtures live in conftest.py files, which
    pytest loads itself: importing conftest (or a test module) as a module runs it a second time
    under another name, as pytest's documentation warns."""
    bad = [
        f"{f.relative_to(ROOT)} imports {name}"
        for f in python_files("tests")
        for name in imported_modules(f)
        if name.split(".")[0] == "conftest" or name.split(".")[0].startswith("test_")
    ]
    assert not bad, "import shared code from tests/helpers/ instead:\n" + "\n".join(bad)


def test_test_helpers_live_in_the_helpers_package():
    """Every module under tests/ is a test module, a conftest.py, or part of tests/helpers/."""
    stray = [
        str(f.relative_to(ROOT))
        for f in python_files("tests")
        if not f.name.startswith("test_")
        and f.name != "conftest.py"
        and f.parent != ROOT / "tests" / "helpers"
    ]
    assert not stray, "move these into tests/helpers/:\n" + "\n".join(stray)


# the router's modules that may start the OpenAI HTTP front: the rest of the router (the call on
# the workers, the pool, membership, metrics) serves gRPC alone and never reaches into it
HTTP_FRONT = "pdserve.router.openai"
STARTS_THE_HTTP_FRONT = {"router/server.py"}


def test_the_router_reaches_its_http_front_only_where_it_starts_it():
    front = ROOT / "router" / "openai"
    assert (front / "__init__.py").is_file(), "router/openai/ is the HTTP front's package"
    bad = []
    for f in sorted((ROOT / "router").rglob("*.py")):
        if f.is_relative_to(front) or str(f.relative_to(ROOT)) in STARTS_THE_HTTP_FRONT:
            continue
        names = imported_modules(f)
        if any(n == HTTP_FRONT or n.startswith(HTTP_FRONT + ".") for n in names):
            bad.append(str(f.relative_to(ROOT)))
    assert not bad, f"modules of the router that import its HTTP front: {bad}"


# Product code: every folder that installs (tests, benchmarks and experiments are not product).
MAX_FUNCTION_LINES = 80


def test_no_product_function_is_longer_than_80_lines():
    """A module may be as long as its one concept needs; a function may not: past a screen it is
    several steps that want names. Counted from `def` to its last line, nested functions included
    in their parent (and also counted alone)."""
    long = [
        f"{f.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for f in python_files(*INSTALLED)
        if not f.name.endswith(("_pb2.py", "_pb2_grpc.py"))
        for node in ast.walk(parsed(f))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, (
        f"break these up by what they do (<= {MAX_FUNCTION_LINES} lines):\n" + "\n".join(long)
    )
