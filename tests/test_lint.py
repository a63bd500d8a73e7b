"""The package and its scripts pass pyflakes: a name lost in a move (an import a refactor dropped)
fails here instead of on the GPU machine (session 15: `ostinato skew --max-sessions` raised
NameError there, on a path no other test ran)."""
from __future__ import annotations

import io
from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes.reporter import Reporter  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("folder", ["ostinato", "scripts"])
def test_pyflakes_finds_nothing(folder):
    out, err = io.StringIO(), io.StringIO()
    found = pyflakes_api.checkRecursive([str(ROOT / folder)], Reporter(out, err))
    assert found == 0 and not err.getvalue(), out.getvalue() + err.getvalue()


def _module_imports() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports, inside functions too: a lazy
    import (a command loading the engine only when it runs) is still a dependency, and one inside a
    kernel's function was session 43's way back from kernels to layers, which a count of module-level
    imports missed."""
    import ast

    names = {}
    for path in (ROOT / "ostinato").rglob("*.py"):
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        names[mod] = path
    graph = {}
    for mod, path in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ostinato"):
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[mod] = {d for d in deps if d in names and d != mod}
    return graph


def _part(mod: str) -> str:
    return ".".join(mod.split(".")[:2])  # ostinato.engine.runner -> ostinato.engine


def test_no_import_cycle_between_the_packages_parts():
    """The package's parts (engine, planner, layers, load, ...) import each other one way only."""
    edges: dict[str, set[str]] = {}
    for mod, deps in _module_imports().items():
        edges.setdefault(_part(mod), set()).update(_part(d) for d in deps if _part(d) != _part(mod))

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            for n in edges.get(todo.pop(), ()):
                if n == b:
                    return True
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return False

    cycles = sorted((a, b) for a, bs in edges.items() for b in bs if a < b and reaches(b, a))
    assert not cycles, f"parts that import each other (directly or around a loop): {cycles}"


def test_the_device_carry_names_committed_inputs(tmp_path):
    """scripts/device/carry.sh builds .carry from committed results: each file it names is in the tree (a results
    folder renamed or pruned fails here, not in a device call's first minutes); ../shared's parts are faked."""
    import subprocess

    (tmp_path / "workloads").mkdir()
    (tmp_path / "llama").mkdir()
    for name in ("kit.tar.xz", "unpack.sh"):
        (tmp_path / "llama" / name).touch()
    run = lambda shared: subprocess.run(["bash", str(ROOT / "scripts/device/carry.sh"), "--check"],  # noqa: E731
                                        env={"PATH": "/usr/bin:/bin", "SHARED": str(shared)}, capture_output=True,
                                        text=True)
    ok = run(tmp_path)
    assert ok.returncode == 0 and "every input is here" in ok.stdout, ok.stderr
    (tmp_path / "llama" / "unpack.sh").unlink()
    bad = run(tmp_path)
    assert bad.returncode == 1 and "unpack.sh is missing" in bad.stderr
