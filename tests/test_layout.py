"""The layout keeps its promises (docs: README "Architecture in a few lines"): the client library imports nothing
of the server and none of the heavy optional packages, the engine never imports the transport, no two modules
import each other (directly or around a cycle), each package says what it holds, the client's public API is
documented."""
import ast
import inspect
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# import name -> source folder (pyproject.toml's package-dir)
PACKAGES = {"drafter_service": ROOT / "drafter_service", "drafter_client": ROOT / "clients",
            "drafter_kernels": ROOT / "kernels"}
HEAVY = ("transformers", "matplotlib", "tokenizers", "uvloop")


def modules() -> dict[str, pathlib.Path]:
    """Every module of the three packages by dotted name (a package by its own name, for its __init__.py)."""
    found = {}
    for name, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([name, *parts])] = path
    return found


def imports_of(name: str, path: pathlib.Path, known: dict) -> set[str]:
    """The project modules `name` imports anywhere in its file (module level or inside a function)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` names a module when pkg.sub is one, else a name inside pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def test_client_library_imports_no_server_and_no_heavy_packages():
    code = ("import sys, drafter_client, drafter_client.client, drafter_client.sync, drafter_client.session\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {('drafter_service',) + HEAVY!r})\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import drafter_client pulled in: {out}"


def test_server_core_does_not_import_transformers():
    code = ("import sys, drafter_service.cli, drafter_service.server, drafter_service.runtime, drafter_service.loader\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'tokenizers', "
            "'matplotlib'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"the server core pulled in: {out}"


def test_engine_never_imports_the_transport_or_grpc():
    known = modules()
    for name, path in known.items():
        if not name.startswith("drafter_service.engine") and not name.startswith("drafter_service.models"):
            continue
        bad = {m for m in imports_of(name, path, known) if m.startswith("drafter_service.transport")}
        assert not bad, f"{name} imports the transport: {sorted(bad)}"
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(m.split(".")[0] == "grpc" for m in mods), f"{name} imports grpc"


def test_client_never_imports_the_server():
    known = modules()
    for name, path in known.items():
        if name.startswith("drafter_client") and not name.startswith("drafter_client.benchmarks"):
            bad = {m for m in imports_of(name, path, known) if m.startswith("drafter_service")}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_no_import_cycles():
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycle = stack[stack.index(m):] + [m]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_every_package_says_what_lives_there():
    for path in [p for folder in PACKAGES.values() for p in folder.rglob("__init__.py")]:
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and len(doc) > 40, f"{path.relative_to(ROOT)} has no docstring saying what lives there"


def test_server_top_level_holds_only_the_wiring():
    top = sorted(p.name for p in (ROOT / "drafter_service").glob("*.py"))
    assert len([p for p in top if p != "__init__.py"]) <= 10, top
    assert {"engine", "transport", "models", "training"} <= {p.name for p in (ROOT / "drafter_service").iterdir()
                                                              if p.is_dir()}


def test_client_ships_py_typed():
    assert (ROOT / "clients" / "py.typed").is_file()


@pytest.mark.parametrize("module", ["drafter_client.batch", "drafter_client.breaker", "drafter_client.client", "drafter_client.messages",
                                    "drafter_client.session", "drafter_client.sync", "drafter_client.shm_ring",
                                    "drafter_client.step_channel", "drafter_client.engine_fc"])
def test_client_public_api_has_docstrings(module):
    import importlib

    mod = importlib.import_module(module)
    missing = []
    for name, obj in vars(mod).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            if not inspect.getdoc(obj):
                missing.append(name)
            if inspect.isclass(obj):
                for meth, fn in vars(obj).items():
                    if meth.startswith("_") or not (inspect.isfunction(fn) or isinstance(fn, property)):
                        continue
                    if not (fn.__doc__ or "").strip():
                        missing.append(f"{name}.{meth}")
    assert not missing, f"{module}: no docstring on {missing}"
