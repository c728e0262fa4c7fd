"""Install a package whose build compiles C++ against the installed torch, building its wheel only
once per machine (``make setup`` / ``make test``: torchsort, and DeepSpeed with its CPU ops).

``pip`` caches downloads and wheels, but such a package must be built against the environment's
torch (``--no-build-isolation``), and a wheel built in one virtual environment is not found from
another: every new clone compiled again (about 45 s for torchsort, 70-150 s for DeepSpeed's ops on
2 cores). Here the built wheel is kept under ``$UNICON_WHEEL_CACHE`` (default
``~/.cache/unicon/wheels``), in a folder named by everything the compiled code depends on:

    <name>-<version>-<variant>-torch<torch version>-<python cache tag>-<machine>[-cpu<flags hash>]

``--native`` adds a hash of the CPU's flags (``/proc/cpuinfo``) for a build that compiles with
``-march=native`` (DeepSpeed's CPU ops), so that a home folder shared with another CPU builds again.

Usage::

    python scripts/wheel_cache.py NAME==VERSION [--variant V] [--native] [--env K=V ...]

The first run builds the wheel from the package index's source distribution (``pip download``, then
``pip wheel --no-build-isolation --no-deps``, extra environment from ``--env``), and moves it into
the cache folder in one rename; every run then installs it with ``pip install --no-deps
--force-reinstall``. It prints one line saying which of the two happened. A failed build leaves no
cache folder behind.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def cache_root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "unicon" / "wheels"
    return Path(os.environ.get("UNICON_WHEEL_CACHE") or default)


def cpu_flags_hash() -> str:
    """A short hash of the first CPU's ``flags`` line: what ``-march=native`` compiles for."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def cache_key(requirement: str, variant: str, native: bool) -> str:
    import torch

    name, _, version = requirement.partition("==")
    if not name or not version:
        raise SystemExit(f"wheel_cache: {requirement!r} is not NAME==VERSION")
    parts = [name, version, variant, f"torch{torch.__version__}", sys.implementation.cache_tag, platform.machine()]
    if native:
        parts.append(f"cpu{cpu_flags_hash()}")
    return "-".join(parts).replace("+", "_").replace("/", "_")


def pip(*args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env=env)


def build(requirement: str, folder: Path, env: dict[str, str]) -> None:
    """Build ``requirement``'s wheel from its source distribution into ``folder`` (created by one
    rename at the end, so that an interrupted or failed build leaves nothing)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **env}
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}.") as tmp:
        sdist, wheel = Path(tmp) / "sdist", Path(tmp) / "wheel"
        pip("download", "-q", "--no-deps", "--no-build-isolation", "--no-binary", ":all:", requirement, "-d", str(sdist),
            env=env)
        archives = sorted(sdist.iterdir())
        if len(archives) != 1:
            raise SystemExit(f"wheel_cache: expected one source distribution of {requirement}, got {archives}")
        pip("wheel", "-q", "--no-build-isolation", "--no-deps", str(archives[0]), "-w", str(wheel), env=env)
        built = list(wheel.glob("*.whl"))
        if len(built) != 1:
            raise SystemExit(f"wheel_cache: the build of {requirement} wrote {built}, not one wheel")
        try:
            wheel.rename(folder)
        except OSError:  # another set-up built it meanwhile: keep theirs
            if not any(folder.glob("*.whl")):
                raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("requirement", help="NAME==VERSION")
    parser.add_argument("--variant", default="default", help="what else the build depends on (e.g. cpu, cuda)")
    parser.add_argument("--native", action="store_true", help="the build compiles for this CPU (-march=native)")
    parser.add_argument("--env", action="append", default=[], metavar="K=V", help="environment of the build")
    args = parser.parse_args(argv)
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--env {item!r} is not K=V")
        env[key] = value

    folder = cache_root() / cache_key(args.requirement, args.variant, args.native)
    t0 = time.monotonic()
    cached = any(folder.glob("*.whl"))
    if not cached:
        build(args.requirement, folder, env)
    wheel = sorted(folder.glob("*.whl"))[0]
    pip("install", "-q", "--no-deps", "--force-reinstall", str(wheel))
    how = "installed from the wheel cache" if cached else "built, cached and installed"
    print(f"wheel_cache: {args.requirement} {how} ({time.monotonic() - t0:.0f} s): {wheel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
