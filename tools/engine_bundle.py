"""Carry an inference engine (vLLM, ...) to a machine with no package index: build a trimmed install tree
from wheels where pip works, pack it in parts of a size a transfer allows, and on the target unpack, verify
checksums and print what runs.  Standard library only (``python3 tools/engine_bundle.py ...``): the target
needs nothing but Python.  docs/external-engines.md, "Bringing vLLM to a machine without an index".

    build MANIFEST --out DIR [--wheels CACHE] [--part-mb 56] [--add FILE ...]
        download the manifest's wheels for its Python and platforms (pip download --no-deps), install
        them into DIR/tree/site (pip install --target, cross-version), remove the manifest's ``trim``
        paths, check what can be checked here (requirements, shared libraries, pure-Python imports),
        pack ``site`` and the ``--add`` files into DIR/parts/*.part-NN with INDEX.json (sha256 of each
        part and of the whole archive).
    unpack PARTS_DIR --dest DEST      verify every part and the archive, extract to DEST (DEST/site, DEST/files)
    verify DEST                       import the manifest's modules with DEST/site on the path; print the
                                      engine / torch / GPU / attention-backend line
    env DEST                          the environment lines to source before starting the engine

A manifest (tools/bundles/*.toml) names the wheels, what to trim, the modules to import and what the target
must already have; see tools/bundles/vllm-0.26.0.toml.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

try:
    import tomllib
except ImportError:  # pragma: no cover - Python < 3.11
    tomllib = None

try:  # run as a script (python3 tools/engine_bundle.py) or imported as kvbench.tools.engine_bundle
    from engine_bundle_checks import pure_import_check, unmet_requirements, unresolved_libraries
except ImportError:
    from kvbench.tools.engine_bundle_checks import pure_import_check, unmet_requirements, unresolved_libraries

INDEX = "INDEX.json"
ARCHIVE = "bundle.tar"


class BundleError(Exception):
    pass


def load_manifest(path: Path) -> dict:
    if tomllib is None:
        raise BundleError("reading a manifest needs Python >= 3.11 (tomllib)")
    data = tomllib.loads(Path(path).read_text())
    for key in ("name", "python", "platforms", "wheels"):
        if key not in data:
            raise BundleError(f"{path}: manifest has no {key!r}")
    return data


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _pip_platform_args(manifest: dict) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", manifest["python"], "--implementation", "cp"]
    for p in manifest["platforms"]:
        args += ["--platform", p]
    return args


# --- build -----------------------------------------------------------------------------------------------

def download(manifest: dict, cache: Path) -> list[Path]:
    """One wheel per manifest pin in ``cache`` (downloaded when missing)."""
    cache.mkdir(parents=True, exist_ok=True)
    found = []
    for spec in manifest["wheels"]:
        name, _, version = spec.partition("==")
        if not version:
            raise BundleError(f"wheel {spec!r}: pin an exact version (name==version)")
        prefix = f"{_norm(name)}-{version}-"
        have = [p for p in cache.glob("*.whl") if _norm(p.name.split("-")[0]) + "-" + p.name.split("-")[1] + "-" == prefix]
        if not have:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), *_pip_platform_args(manifest), spec]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise BundleError(f"pip download {spec} failed:\n{r.stderr[-2000:]}")
            have = [p for p in cache.glob("*.whl") if _norm(p.name.split("-")[0]) + "-" + p.name.split("-")[1] + "-" == prefix]
        if len(have) != 1:
            raise BundleError(f"{spec}: expected one wheel in {cache}, found {[p.name for p in have]}")
        found.append(have[0])
    return found


def install(manifest: dict, wheels: list[Path], site: Path) -> None:
    if site.exists():
        shutil.rmtree(site)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(site),
           *_pip_platform_args(manifest), *map(str, wheels)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BundleError(f"pip install --target failed:\n{r.stderr[-2000:]}")
    shutil.rmtree(site / "bin", ignore_errors=True)  # console scripts point at this machine's interpreter


def trim(site: Path, patterns: list[str]) -> int:
    """Remove the paths matching ``patterns`` (relative to ``site``); returns the bytes removed."""
    removed = 0
    for pattern in patterns:
        for path in sorted(site.glob(pattern), key=lambda p: -len(p.parts)):
            if path.is_dir():
                removed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                shutil.rmtree(path)
            elif path.exists():
                removed += path.stat().st_size
                path.unlink()
    return removed


def tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())


def pack(out: Path, site: Path, extra: list[Path], manifest: dict, part_mb: float) -> dict:
    """DIR/parts/bundle.tar.part-NN + INDEX.json; the tar holds site.tar.xz, files/* and bundle.json."""
    parts_dir = out / "parts"
    if parts_dir.exists():
        shutil.rmtree(parts_dir)
    parts_dir.mkdir(parents=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        tmp = Path(tmp)
        xz = tmp / "site.tar.xz"
        with tarfile.open(xz, "w:xz", preset=9) as t:
            t.add(site, arcname=".")
        (tmp / "bundle.json").write_text(json.dumps(manifest, indent=1))
        archive = tmp / ARCHIVE
        with tarfile.open(archive, "w") as t:
            t.add(xz, arcname="site.tar.xz")
            t.add(tmp / "bundle.json", arcname="bundle.json")
            for f in extra:
                packed = tmp / (f.name + ".xz")
                with open(f, "rb") as src, lzma.open(packed, "wb", preset=6) as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                t.add(packed, arcname=f"files/{f.name}.xz")
        size = archive.stat().st_size
        part = int(part_mb * 1024 * 1024)
        index = {"name": manifest["name"], "archive": ARCHIVE, "archive_sha256": sha256(archive), "archive_bytes": size, "parts": []}
        with open(archive, "rb") as f:
            for i in range(0, max(1, -(-size // part))):
                p = parts_dir / f"{ARCHIVE}.part-{i:02d}"
                p.write_bytes(f.read(part))
                index["parts"].append({"name": p.name, "bytes": p.stat().st_size, "sha256": sha256(p)})
    (parts_dir / INDEX).write_text(json.dumps(index, indent=1))
    return index


def cmd_build(args) -> int:
    manifest = load_manifest(args.manifest)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.wheels) if args.wheels else out / "wheels"
    wheels = download(manifest, cache)
    print(f"{len(wheels)} wheels in {cache} ({sum(w.stat().st_size for w in wheels) / 1e6:.1f} MB)")
    site = out / "tree" / "site"
    install(manifest, wheels, site)
    before = tree_bytes(site)
    removed = trim(site, manifest.get("trim", []))
    print(f"installed {before / 1e6:.1f} MB, trimmed {removed / 1e6:.1f} MB -> {tree_bytes(site) / 1e6:.1f} MB in {site}")
    unmet = unmet_requirements(manifest, wheels)
    if unmet:
        print(f"not bundled and not listed as on the target ({len(unmet)}; imported lazily or not on the serve path): "
              + ", ".join(sorted(unmet)))
    libs = unresolved_libraries(site, manifest.get("provided_libs", []))
    for lib, users in sorted(libs.items()):
        print(f"shared library {lib} is not in the bundle and not listed as provided (needed by {', '.join(users[:3])})")
    passed, failed, skipped = pure_import_check(manifest, wheels, site)
    print(f"imported here with Python {sys.version_info.major}.{sys.version_info.minor}: {len(passed)} pure-Python modules"
          f" ({skipped} more need compiled wheels for Python {manifest['python']}; verify imports them on the target)"
          + (f"; FAILED: {'; '.join(failed)}" if failed else ""))
    extra = [Path(f) for f in args.add or []]
    for f in extra:
        if not f.is_file():
            raise BundleError(f"--add {f}: no such file")
    index = pack(out, site, extra, manifest, args.part_mb)
    print(f"packed {index['archive_bytes'] / 1e6:.1f} MB in {len(index['parts'])} parts of <= {args.part_mb} MiB: "
          + ", ".join(p["name"] for p in index["parts"]) + f" (+ {INDEX}) in {out / 'parts'}")
    return 1 if (libs or failed) and args.strict else 0


# --- target side -----------------------------------------------------------------------------------------

def cmd_unpack(args) -> int:
    parts_dir, dest = Path(args.parts), Path(args.dest)
    index = json.loads((parts_dir / INDEX).read_text())
    missing = [p["name"] for p in index["parts"] if not (parts_dir / p["name"]).is_file()]
    if missing:
        raise BundleError(f"{parts_dir}: parts missing: {', '.join(missing)} (carry them, then unpack again)")
    for p in index["parts"]:
        got = sha256(parts_dir / p["name"])
        if got != p["sha256"]:
            raise BundleError(f"{p['name']}: sha256 {got} != {p['sha256']} in {INDEX} (a broken transfer: carry it again)")
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / ARCHIVE
    with open(archive, "wb") as out:
        for p in index["parts"]:
            with open(parts_dir / p["name"], "rb") as f:
                shutil.copyfileobj(f, out)
    if sha256(archive) != index["archive_sha256"]:
        raise BundleError("the reassembled archive's sha256 does not match INDEX.json")
    with tarfile.open(archive) as t:
        t.extractall(dest, filter="data")
    archive.unlink()
    site = dest / "site"
    if site.exists():
        shutil.rmtree(site)
    site.mkdir()
    with tarfile.open(dest / "site.tar.xz") as t:
        t.extractall(site, filter="data")
    (dest / "site.tar.xz").unlink()
    for packed in sorted((dest / "files").glob("*.xz")) if (dest / "files").is_dir() else []:
        with lzma.open(packed) as src, open(packed.with_suffix(""), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        packed.unlink()
    manifest = json.loads((dest / "bundle.json").read_text())
    write_launchers(dest, manifest)
    if args.remove_parts:
        for p in index["parts"]:
            (parts_dir / p["name"]).unlink()
    print(f"{index['name']}: {len(index['parts'])} parts verified, {tree_bytes(site) / 1e6:.0f} MB in {site}"
          + (f"; files: {', '.join(sorted(os.listdir(dest / 'files')))}" if (dest / "files").is_dir() else ""))
    return 0 if args.no_verify else cmd_verify(args)


def write_launchers(dest: Path, manifest: dict) -> list[Path]:
    """DEST/bin/NAME for each ``console_scripts`` entry (``vllm = "vllm.entrypoints.cli.main"``): a pip
    ``--target`` tree has no console scripts, and recipes call ``vllm serve``."""
    out = []
    for name, module in manifest.get("console_scripts", {}).items():
        path = dest / "bin" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#!/bin/sh\nexec {sys.executable} -m {module} \"$@\"\n")
        path.chmod(0o755)
        out.append(path)
    return out


def environment(dest: Path, manifest: dict) -> dict:
    env = {k: str(v).format(dest=dest) for k, v in manifest.get("environment", {}).items()}
    env["PYTHONPATH"] = str(dest / "site") + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    if manifest.get("console_scripts"):
        env["PATH"] = str(dest / "bin") + os.pathsep + os.environ.get("PATH", "")
    return env


VERIFY_CODE = r"""
import importlib, json, sys
out = {"imports": {}}
for name in %(imports)r:
    try:
        importlib.import_module(name); out["imports"][name] = "ok"
    except Exception as e:
        out["imports"][name] = f"{type(e).__name__}: {e}"[:300]
try:
    import torch
    out["torch"] = torch.__version__; out["cuda"] = torch.version.cuda
    out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    out["capability"] = list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None
except Exception as e:
    out["torch"] = f"unavailable: {e}"
try:
    import vllm
    out["engine"] = "vllm " + vllm.__version__
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    out["attention_backends"] = [b.name for b in AttentionBackendEnum]
    import vllm.vllm_flash_attn.flash_attn_interface as fa
    out["fa3"] = bool(getattr(fa, "FA3_AVAILABLE", False)); out["fa3_reason"] = getattr(fa, "FA3_UNAVAILABLE_REASON", None)
except Exception as e:
    out.setdefault("engine", f"vllm unavailable: {type(e).__name__}: {e}"[:300])
try:
    from importlib.metadata import version
    out["target_has"] = {}
    for spec in %(target_has)r:
        name, _, want = spec.partition("==")
        try:
            got = version(name)
            out["target_has"][spec] = "ok" if not want or got == want or got.split("+")[0] == want else f"found {got}"
        except Exception:
            out["target_has"][spec] = "missing"
except Exception:
    pass
print(json.dumps(out))
"""


def cmd_verify(args) -> int:
    dest = Path(args.dest)
    manifest = json.loads((dest / "bundle.json").read_text())
    env = dict(os.environ, **environment(dest, manifest))
    code = VERIFY_CODE % {"imports": manifest.get("imports", []), "target_has": manifest.get("target_has", [])}
    # from the bundle's folder: run from a kvbench checkout, `-c` would put its top-level folders (kernels/,
    # core/, tools/, ...) on the path as packages of those names, and whatever probes for such a package
    # imports them ("No module named 'kvbench'" from vllm.entrypoints.openai.api_server)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=dest)
    try:
        info = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise BundleError(f"verify failed to run:\n{r.stderr[-3000:]}") from None
    bad = {k: v for k, v in info["imports"].items() if v != "ok"}
    wrong = {k: v for k, v in info.get("target_has", {}).items() if v != "ok"}
    cap = info.get("capability")
    fa3 = "FA3 yes" if info.get("fa3") else f"FA3 no ({info.get('fa3_reason')})"
    print(f"{info.get('engine')} | torch {info.get('torch')} CUDA {info.get('cuda')} | {info.get('gpu')}"
          + (f" (sm_{cap[0]}{cap[1]})" if cap else "") + f" | {fa3} | attention backends: {', '.join(info.get('attention_backends', []))}")
    for k, v in bad.items():
        print(f"import {k}: {v}")
    for k, v in wrong.items():
        print(f"target package {k}: {v}")
    return 1 if bad or wrong else 0


def cmd_env(args) -> int:
    dest = Path(args.dest)
    manifest = json.loads((dest / "bundle.json").read_text())
    for k, v in environment(dest, manifest).items():
        print(f"export {k}={v}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="engine_bundle", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download, install, trim, check and pack (where pip works)")
    b.add_argument("manifest", type=Path)
    b.add_argument("--out", required=True)
    b.add_argument("--wheels", help="wheel cache (default OUT/wheels)")
    b.add_argument("--part-mb", type=float, default=56.0, help="largest part in MiB (default 56)")
    b.add_argument("--add", action="append", help="a file to carry along (extracted to DEST/files/)")
    b.add_argument("--strict", action="store_true", help="exit 1 on an unresolved library or a failed import")
    u = sub.add_parser("unpack", help="verify the parts and extract (on the target)")
    u.add_argument("parts")
    u.add_argument("--dest", required=True)
    u.add_argument("--remove-parts", action="store_true")
    u.add_argument("--no-verify", action="store_true")
    v = sub.add_parser("verify", help="import the engine and print its line (on the target)")
    v.add_argument("dest")
    e = sub.add_parser("env", help="print the environment to source (on the target)")
    e.add_argument("dest")
    args = ap.parse_args(argv)
    try:
        return {"build": cmd_build, "unpack": cmd_unpack, "verify": cmd_verify, "env": cmd_env}[args.cmd](args)
    except BundleError as e:
        print(f"engine_bundle: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
