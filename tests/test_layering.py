"""The package layering, enforced.

Layers (lowest first): core -> kernels -> runtime; core -> suites; core -> reports (reports may also
import suites); harness and tools on top, importing anything. The walker reads every ``import`` /
``from ... import`` (absolute and relative, at module level and inside functions), every
``importlib.import_module("kvbench...")`` / ``__import__`` with a literal name, and every
``"kvbench.pkg.mod:attr"`` entry-point string, maps each to its kvbench package, and reports the edges
that go the wrong way. The folder -> package map is read from pyproject.toml's ``package-dir``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# layer -> the layers it may not import (the list; harness and tools may import anything)
FORBIDDEN: dict[str, frozenset[str]] = {
    "core": frozenset({"kernels", "runtime", "suites", "reports", "harness", "tools", "configs"}),
    "kernels": frozenset({"runtime", "suites", "reports", "harness", "tools"}),
    "runtime": frozenset({"suites", "reports", "harness", "tools"}),
    "suites": frozenset({"runtime", "kernels", "reports", "harness", "tools"}),
    "reports": frozenset({"runtime", "kernels", "harness", "tools"}),
}
# third-party modules the core layer may not import when it is imported (function bodies may)
CORE_HEAVY = ("torch", "numpy", "triton")


@dataclass(frozen=True)
class Edge:
    file: str  # path relative to the tree's root
    line: int
    source: str  # importing module, "kvbench.runtime.engine"
    target: str  # imported kvbench module (or third-party top-level name), "kvbench.harness.store"
    at_module_level: bool  # runs when the module is imported (not inside a def / TYPE_CHECKING)

    @property
    def source_layer(self) -> str:
        return layer_of(self.source)

    @property
    def target_layer(self) -> str | None:
        return layer_of(self.target) if self.target.startswith("kvbench.") else None


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "kvbench" else ""


def package_dirs(root: Path) -> dict[str, Path]:
    """``{"kvbench.harness": root/"harness", ...}`` from pyproject.toml's ``[tool.setuptools] package-dir``."""
    data = tomllib.loads((root / "pyproject.toml").read_text())
    mapping = data["tool"]["setuptools"]["package-dir"]
    return {pkg: root / folder for pkg, folder in mapping.items()}


def iter_modules(root: Path):
    """Yield ``(path, dotted module name, is_package_init)`` for every .py file under every mapped folder."""
    for pkg, folder in sorted(package_dirs(root).items()):
        if not folder.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            rel = Path(dirpath).relative_to(folder)
            base = ".".join([pkg, *rel.parts])
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = Path(dirpath) / name
                if name == "__init__.py":
                    yield path, base, True
                else:
                    yield path, f"{base}.{name[:-3]}", False


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve_relative(module: str, is_init: bool, level: int, name: str | None) -> str:
    package = module if is_init else module.rpartition(".")[0]
    parts = package.split(".")
    if level - 1 > len(parts) - 1:
        raise ImportError(f"relative import beyond the top of {module}")
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _literal_prefix(node: ast.expr) -> str | None:
    """The module name an ``import_module`` argument names: a string literal, or an f-string's literal head."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        head = node.values[0]
        if isinstance(head, ast.Constant) and isinstance(head.value, str):
            return head.value.rstrip(".")  # "kvbench.harness.commands.{x}" -> its package
    return None


def module_edges(path: Path, module: str, is_init: bool, root: Path) -> list[Edge]:
    """Every import edge of one file (kvbench targets and third-party top-level names)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = path.relative_to(root).as_posix()
    edges: list[Edge] = []

    def add(line: int, target: str, top: bool) -> None:
        edges.append(Edge(rel, line, module, target, top))

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node.lineno, alias.name, top)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(module, is_init, node.level, node.module)
            else:
                base = node.module or ""
            if base == "kvbench":  # `from kvbench import runtime` / `from .. import runtime`
                for alias in node.names:
                    add(node.lineno, f"kvbench.{alias.name}", top)
            else:
                add(node.lineno, base, top)
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("import_module", "__import__") and node.args:
                target = _literal_prefix(node.args[0])
                if target and target.startswith("kvbench"):
                    add(node.lineno, target, top)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # entry-point style references "kvbench.pkg.mod:attr" (lazy registries import them by name)
            value = node.value
            mod, sep, attr = value.partition(":")
            if sep and mod.startswith("kvbench.") and attr.isidentifier() and all(
                p.isidentifier() for p in mod.split(".")
            ):
                add(node.lineno, mod, False)
        # descend: a def / lambda body runs later; a TYPE_CHECKING block never runs
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, top)
            return
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, True)
    return edges


def all_edges(root: Path) -> list[Edge]:
    return [e for path, mod, init in iter_modules(root) for e in module_edges(path, mod, init, root)]


def violations(root: Path) -> list[str]:
    """One line per forbidden edge: ``file:line imports kvbench.X.y (layer A may not import layer B)``."""
    known = {layer_of(pkg) for pkg in package_dirs(root)}
    bare = {p.name for p in package_dirs(root).values()} | known
    out: list[str] = []
    for e in all_edges(root):
        src = e.source_layer
        dst = e.target_layer
        top_name = e.target.split(".")[0]
        if dst is not None:
            if dst and dst not in known:
                out.append(f"{e.file}:{e.line} imports {e.target} (no package kvbench.{dst} in pyproject's package-dir)")
            elif dst in FORBIDDEN.get(src, ()):
                out.append(f"{e.file}:{e.line} imports {e.target} (layer {src} may not import layer {dst})")
        elif top_name in bare and top_name != "kvbench":
            out.append(f"{e.file}:{e.line} imports {e.target} (a bare top-level name; use kvbench.{e.target})")
        elif src == "core" and top_name in CORE_HEAVY and e.at_module_level:
            out.append(f"{e.file}:{e.line} imports {e.target} (layer core may not import {top_name} at module level)")
    return out


# --------------------------------------------------------------------------- the repository


def test_repository_has_no_forbidden_import_edges():
    found = violations(ROOT)
    assert not found, f"{len(found)} forbidden import edge(s):\n" + "\n".join(found)


def test_walker_sees_the_whole_repository():
    """The walk is not vacuous: it reaches every mapped folder and finds the edges known to exist."""
    dirs = package_dirs(ROOT)
    for pkg in ("kvbench.kernels", "kvbench.runtime", "kvbench.suites", "kvbench.reports", "kvbench.harness"):
        assert pkg in dirs and dirs[pkg].is_dir(), pkg
    edges = all_edges(ROOT)
    files = {e.file for e in edges}
    assert len(files) > 100
    pairs = {(e.source, e.target) for e in edges}
    assert ("kvbench.runtime.engine", "kvbench.runtime.scheduler") in pairs
    # dynamic imports: the CLI's command modules
    assert ("kvbench.harness.cli", "kvbench.harness.commands") in pairs


def test_walker_reads_entry_point_strings(tmp_path):
    """A lazy registry's "kvbench.pkg.mod:attr" string is an edge (a core table naming a runtime class would be
    an upward edge); the attention backends' implementations are named relative to their package instead
    (core/backends.py ``BackendSpec.impl``, resolved in runtime/attention/registry.py)."""
    f = tmp_path / "mod.py"
    f.write_text('PATHS = {"torch": "kvbench.runtime.attention.torch_backend:TorchBackend"}\n')
    edges = module_edges(f, "kvbench.core.mod", False, tmp_path)
    assert [(e.target, e.at_module_level) for e in edges] == [("kvbench.runtime.attention.torch_backend", False)]


def test_every_package_folder_is_listed_in_pyproject():
    """A folder with Python modules under a mapped folder must be in ``packages`` (or a wheel drops it)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(data["tool"]["setuptools"]["packages"])
    missing = sorted(
        {mod if init else mod.rpartition(".")[0] for _, mod, init in iter_modules(ROOT)} - listed
    )
    assert not missing, f"packages missing from pyproject.toml: {missing}"


def _core_modules() -> list[str]:
    return sorted(mod for _, mod, init in iter_modules(ROOT) if layer_of(mod) == "core" and not init)


def test_core_imports_without_torch_numpy_triton():
    """Importing every core module leaves torch, numpy and triton unloaded (checked in a fresh interpreter)."""
    dirs = package_dirs(ROOT)
    assert "kvbench.core" in dirs, "pyproject.toml maps no kvbench.core package"
    mods = _core_modules()
    for needed in ("kvbench.core.formats", "kvbench.core.backends", "kvbench.core.client", "kvbench.core.io"):
        assert needed in mods, f"{needed} missing"
    code = (
        f"import {', '.join(mods)}; import sys; "
        f"bad = [m for m in {CORE_HEAVY!r} if m in sys.modules]; "
        "assert not bad, f'importing kvbench.core loaded {bad}'; print('ok', len(sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr


# --------------------------------------------------------------------------- the walker itself


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [tool.setuptools]
            package-dir = { "kvbench.core" = "core", "kvbench.kernels" = "kernels", "kvbench.runtime" = "rt", "kvbench.harness" = "harness" }
            packages = ["kvbench.core", "kvbench.kernels", "kvbench.runtime", "kvbench.runtime.sub", "kvbench.harness"]
            """
        )
    )
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return tmp_path


def test_walker_reports_planted_upward_edges(tmp_path):
    root = _tree(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/ok.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    import torch
                def f():
                    import numpy
                    return numpy
            """,
            "core/bad.py": """
                import json
                import torch
                from kvbench.kernels import q
            """,
            "kernels/__init__.py": "",
            "kernels/k.py": """
                from kvbench.core import ok
                from ..runtime import engine

                def later():
                    from kvbench.harness.store import x
                    return x
            """,
            "rt/__init__.py": "",
            "rt/sub/__init__.py": "from . import m\n",
            "rt/sub/m.py": """
                import importlib
                from .. import engine
                from ...kernels import k
                def load(name):
                    return importlib.import_module(f"kvbench.harness.{name}")
                PATHS = {"a": "kvbench.harness.plugins:Thing", "log": "kvbench.harness"}
                import runtime
            """,
            "rt/engine.py": "import kvbench.core.ok\n",
            "harness/__init__.py": "",
            "harness/h.py": "from kvbench.runtime.sub import m\nfrom kvbench.nothing import y\n",
        },
    )
    assert sorted(violations(root)) == sorted(
        [
            "core/bad.py:3 imports torch (layer core may not import torch at module level)",
            "core/bad.py:4 imports kvbench.kernels (layer core may not import layer kernels)",
            "kernels/k.py:3 imports kvbench.runtime (layer kernels may not import layer runtime)",
            "kernels/k.py:6 imports kvbench.harness.store (layer kernels may not import layer harness)",
            "rt/sub/m.py:6 imports kvbench.harness (layer runtime may not import layer harness)",
            "rt/sub/m.py:7 imports kvbench.harness.plugins (layer runtime may not import layer harness)",
            "rt/sub/m.py:8 imports runtime (a bare top-level name; use kvbench.runtime)",
            "harness/h.py:2 imports kvbench.nothing (no package kvbench.nothing in pyproject's package-dir)",
        ]
    )


def test_walker_resolves_relative_imports(tmp_path):
    root = _tree(
        tmp_path,
        {
            "rt/sub/__init__.py": "from . import m\nfrom .m import f\n",
            "rt/sub/m.py": "from .. import engine\nfrom ..engine import g\nfrom ...kernels.k import h\n",
        },
    )
    got = {(e.file, e.line, e.source, e.target) for e in all_edges(root)}
    assert got == {
        ("rt/sub/__init__.py", 1, "kvbench.runtime.sub", "kvbench.runtime.sub"),
        ("rt/sub/__init__.py", 2, "kvbench.runtime.sub", "kvbench.runtime.sub.m"),
        ("rt/sub/m.py", 1, "kvbench.runtime.sub.m", "kvbench.runtime"),
        ("rt/sub/m.py", 2, "kvbench.runtime.sub.m", "kvbench.runtime.engine"),
        ("rt/sub/m.py", 3, "kvbench.runtime.sub.m", "kvbench.kernels.k"),
    }


def test_walker_flags_unlisted_package_folder(tmp_path):
    root = _tree(tmp_path, {"rt/other/__init__.py": "", "rt/other/x.py": "x = 1\n"})
    data = tomllib.loads((root / "pyproject.toml").read_text())
    listed = set(data["tool"]["setuptools"]["packages"])
    found = {mod if init else mod.rpartition(".")[0] for _, mod, init in iter_modules(root)}
    assert found - listed == {"kvbench.runtime.other"}


# --------------------------------------------------------------------------- entry points
def _exports(init: Path) -> dict[str, str]:
    """A package's entry point: ``{name: submodule}`` from its ``__init__``'s ``_EXPORTS`` table (read, not
    imported)."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def entry_point_violations(root: Path) -> list[str]:
    """Cross-package imports that skip a package's entry point (``from kvbench.runtime.config import
    EngineConfig`` where ``kvbench.runtime`` exports it) or take a private name (``_x``) from another package."""
    exports = {pkg.split(".")[1]: _exports(d / "__init__.py") for pkg, d in package_dirs(root).items()
               if pkg.count(".") == 1 and (d / "__init__.py").exists()}
    out: list[str] = []
    for path, module, _init in iter_modules(root):
        mine = module.split(".")[1] if module.count(".") >= 1 else ""
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvbench.")):
                continue
            parts = node.module.split(".")
            if len(parts) < 2 or parts[1] == mine:
                continue
            rel = path.relative_to(root)
            for a in node.names:
                if a.name.startswith("_"):
                    out.append(f"{rel}:{node.lineno} imports the private name {a.name} from {node.module}")
                elif len(parts) > 2 and a.name in exports.get(parts[1], {}):
                    out.append(f"{rel}:{node.lineno} imports {a.name} from {node.module}; use the entry point "
                               f"kvbench.{parts[1]}")
    return out


def test_no_entry_point_name_is_a_submodule_name():
    """``from kvbench.core import model_identity`` would give the submodule once it is imported, not the function
    of that name: such a name stays a deep import (``from kvbench.core.model_identity import model_identity``)."""
    clashes = []
    for pkg, d in package_dirs(ROOT).items():
        if pkg.count(".") != 1 or not (d / "__init__.py").exists():
            continue
        subs = {p.stem for p in d.rglob("*.py")} | {p.name for p in d.rglob("*") if p.is_dir()}
        clashes += [f"{pkg}.{n}" for n in _exports(d / "__init__.py") if n in subs]
    assert not clashes, clashes


def test_other_packages_use_entry_points_and_no_private_names():
    found = entry_point_violations(ROOT)
    assert not found, f"{len(found)} import(s) around an entry point:\n" + "\n".join(found)


def test_every_entry_point_name_resolves_without_loading_torch():
    code = textwrap.dedent("""
        import importlib, sys
        for pkg in ("core", "kernels", "runtime", "suites", "reports"):
            m = importlib.import_module("kvbench." + pkg)
            assert m.__all__, pkg
        import kvbench.runtime
        kvbench.runtime.EngineConfig
        assert "torch" not in sys.modules, "an entry point loaded torch"
        for pkg in ("core", "kernels", "runtime", "suites", "reports"):
            m = importlib.import_module("kvbench." + pkg)
            for name in m.__all__:
                getattr(m, name)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]


def test_entry_point_rule_sees_a_skipped_entry_point(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "__init__.py").write_text('_EXPORTS = {"Thing": "mod"}\n')
    (tmp_path / "b" / "__init__.py").write_text("")
    (tmp_path / "b" / "use.py").write_text("from kvbench.a.mod import Thing, _hidden\nfrom kvbench.a import Thing\n")
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = {"kvbench.a" = "a", "kvbench.b" = "b"}\n')
    found = entry_point_violations(tmp_path)
    assert sorted(found) == ["b/use.py:1 imports Thing from kvbench.a.mod; use the entry point kvbench.a",
                             "b/use.py:1 imports the private name _hidden from kvbench.a.mod"]
