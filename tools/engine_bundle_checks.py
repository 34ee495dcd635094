"""What ``tools/engine_bundle.py build`` can check on the build machine, before anything travels: runtime
requirements neither bundled nor on the target, shared libraries of the bundle's ``.so`` files that nothing
provides (read from their ELF headers), and imports of the pure-Python wheels this interpreter can load.
Standard library only (``packaging`` through pip's vendored copy when it is not installed)."""

from __future__ import annotations

import fnmatch
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

__all__ = ["unmet_requirements", "elf_needed", "unresolved_libraries", "pure_import_check", "SYSTEM_LIBS"]

SYSTEM_LIBS = ("libc.so*", "libm.so*", "libdl.so*", "librt.so*", "libpthread.so*", "libstdc++.so*",
               "libgcc_s.so*", "ld-linux*.so*", "libutil.so*", "libz.so*", "libresolv.so*")


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _metadata(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode("utf-8", "replace").splitlines()


def _marker_env(manifest: dict) -> dict:
    py = manifest["python"]
    return {"python_version": py, "python_full_version": py + ".0", "platform_machine": "x86_64", "platform_system": "Linux",
            "sys_platform": "linux", "os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "extra": ""}


def _marker_ok(marker: str, env: dict) -> bool:
    """Evaluate a requirement marker for the target (packaging's, through pip's vendored copy if needed)."""
    if not marker:
        return True
    try:
        from packaging.markers import Marker
    except ImportError:  # pragma: no cover
        from pip._vendor.packaging.markers import Marker
    try:
        return Marker(marker).evaluate(env)
    except Exception:
        return True


def unmet_requirements(manifest: dict, wheels: list[Path]) -> dict[str, list[str]]:
    """``{requirement: [wheels needing it]}`` for runtime requirements (no extras, markers true on the target)
    that are neither in the bundle nor in the manifest's ``target_has``."""
    import re

    bundled = {_norm(w.name.split("-")[0]) for w in wheels}
    on_target = {_norm(re.split(r"[=<>!~ \[]", s, 1)[0]) for s in manifest.get("target_has", [])}
    env = _marker_env(manifest)
    unmet: dict[str, list[str]] = {}
    for w in wheels:
        for name in _requires(w, env):
            if name not in bundled and name not in on_target:
                unmet.setdefault(name, []).append(w.name.split("-")[0])
    return unmet


def elf_needed(path: Path) -> list[str]:
    """DT_NEEDED entries of a 64-bit little-endian ELF shared object ([] for anything else)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return []
        e_shoff, = struct.unpack_from("<Q", head, 0x28)
        e_shentsize, e_shnum = struct.unpack_from("<HH", head, 0x3A)
        f.seek(e_shoff)
        sections = [struct.unpack("<IIQQQQIIQQ", f.read(e_shentsize)[:64]) for _ in range(e_shnum)]
        dyn = [s for s in sections if s[1] == 6]  # SHT_DYNAMIC
        if not dyn:
            return []
        _, _, _, _, off, size, link, _, _, entsize = dyn[0]
        strtab = sections[link]
        f.seek(strtab[4])
        strings = f.read(strtab[5])
        f.seek(off)
        raw = f.read(size)
    out = []
    for i in range(0, len(raw), entsize or 16):
        tag, val = struct.unpack_from("<qQ", raw, i)
        if tag == 0:
            break
        if tag == 1:  # DT_NEEDED
            out.append(strings[val:strings.index(b"\0", val)].decode())
    return out


def unresolved_libraries(site: Path, provided: list[str]) -> dict[str, list[str]]:
    """``{library: [.so files needing it]}`` for DT_NEEDED names found neither in the tree, nor among the C
    runtime's, nor in the manifest's ``provided_libs``."""
    in_tree = {p.name for p in site.rglob("*.so*") if p.is_file()}
    patterns = list(SYSTEM_LIBS) + list(provided)
    missing: dict[str, list[str]] = {}
    for so in site.rglob("*.so*"):
        if not so.is_file() or so.is_symlink():
            continue
        for lib in elf_needed(so):
            if lib in in_tree or any(fnmatch.fnmatch(lib, p) for p in patterns):
                continue
            missing.setdefault(lib, []).append(str(so.relative_to(site)))
    return missing


def _requires(wheel: Path, env: dict) -> list[str]:
    import re

    out = []
    for line in _metadata(wheel):
        if line.startswith("Requires-Dist:"):
            req, _, marker = line[len("Requires-Dist:"):].strip().partition(";")
            if "extra" not in marker and _marker_ok(marker.strip(), env):
                out.append(_norm(re.split(r"[=<>!~ \[(]", req.strip(), 1)[0]))
    return out


def pure_import_check(manifest: dict, wheels: list[Path], site: Path) -> tuple[list[str], list[str], int]:
    """Import, with this interpreter, the top-level packages of every pure-Python wheel whose bundled
    requirements (transitively) are pure too and whose other requirements this interpreter has:
    ``(passed, failed, skipped)``.  Compiled wheels for another Python cannot be imported here; ``verify``
    imports everything on the target."""
    import importlib.util

    env = _marker_env(manifest)
    by_name = {_norm(w.name.split("-")[0]): w for w in wheels}
    pure = {n for n, w in by_name.items() if w.name[:-4].split("-")[-1] == "any" and w.name[:-4].split("-")[-2] == "none"}
    reqs = {n: _requires(w, env) for n, w in by_name.items()}

    def checkable(name: str, seen: set) -> bool:
        if name in seen:
            return True
        seen.add(name)
        for r in reqs[name]:
            if r in by_name:
                if r not in pure or not checkable(r, seen):
                    return False
            elif importlib.util.find_spec(r) is None:
                return False
        return True

    passed, failed, skipped = [], [], 0
    for name in sorted(pure):
        if not checkable(name, set()):
            skipped += 1
            continue
        with zipfile.ZipFile(by_name[name]) as z:
            tops = [n for n in z.namelist() if n.endswith("top_level.txt")]
            mods = z.read(tops[0]).decode().split() if tops else []
            if not mods:
                mods = sorted({n.split("/")[0].removesuffix(".py") for n in z.namelist()
                               if not n.split("/")[0].endswith((".dist-info", ".data"))})
        for mod in (m for m in mods if m.isidentifier()):
            code = f"import sys; sys.path.insert(0, {str(site)!r}); import {mod}"
            r = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                passed.append(mod)
            else:
                failed.append(f"{mod} ({(r.stderr.strip().splitlines() or ['?'])[-1][:160]})")
    return passed, failed, skipped
