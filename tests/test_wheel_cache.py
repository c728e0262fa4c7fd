"""``scripts/wheel_cache.py``: a compiled package's wheel is built once per machine and installed
from the cache by every later set-up, from any clone; a failed build leaves nothing behind. pip is
replaced by a recorder (no network, no compiler): the real build runs in ``make setup``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def wheel_cache(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("wheel_cache", REPO / "scripts" / "wheel_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("UNICON_WHEEL_CACHE", str(tmp_path / "cache"))
    calls = []

    def pip(*args, env=None):
        calls.append((args, env))
        if args[0] == "download":
            dest = Path(args[args.index("-d") + 1])
            dest.mkdir(parents=True)
            (dest / "pkg-1.0.tar.gz").write_bytes(b"sdist")
        elif args[0] == "wheel":
            if module.FAIL:
                raise subprocess.CalledProcessError(1, "pip wheel")
            dest = Path(args[args.index("-w") + 1])
            dest.mkdir(parents=True)
            (dest / "pkg-1.0-cp311-cp311-linux_x86_64.whl").write_bytes(b"wheel")

    module.FAIL = False
    monkeypatch.setattr(module, "pip", pip)
    module.calls = calls
    return module


def test_the_first_set_up_builds_and_every_later_one_installs_from_the_cache(wheel_cache, capsys):
    assert wheel_cache.main(["pkg==1.0", "--variant", "cpu", "--env", "DS_BUILD_X=1"]) == 0
    steps = [args[0] for args, _ in wheel_cache.calls]
    assert steps == ["download", "wheel", "install"]
    wheel_args, wheel_env = wheel_cache.calls[1]
    assert "--no-build-isolation" in wheel_args
    assert wheel_env["DS_BUILD_X"] == "1"
    assert "built, cached and installed" in capsys.readouterr().out

    wheel_cache.calls.clear()
    assert wheel_cache.main(["pkg==1.0", "--variant", "cpu"]) == 0
    assert [args[0] for args, _ in wheel_cache.calls] == ["install"]
    installed = Path(wheel_cache.calls[0][0][-1])
    assert installed.name == "pkg-1.0-cp311-cp311-linux_x86_64.whl" and installed.is_file()
    assert "installed from the wheel cache" in capsys.readouterr().out

    # another variant (or torch, Python, CPU) is another folder: built again
    wheel_cache.calls.clear()
    wheel_cache.main(["pkg==1.0", "--variant", "cuda"])
    assert [args[0] for args, _ in wheel_cache.calls] == ["download", "wheel", "install"]


def test_the_key_names_what_the_compiled_code_depends_on(wheel_cache):
    import torch

    key = wheel_cache.cache_key("pkg==1.0", "cpu", native=False)
    assert key.startswith("pkg-1.0-cpu-torch") and sys.implementation.cache_tag in key
    assert torch.__version__.replace("+", "_") in key
    native = wheel_cache.cache_key("pkg==1.0", "cpu", native=True)
    assert native.startswith(key + "-cpu") and native != key
    with pytest.raises(SystemExit, match="NAME==VERSION"):
        wheel_cache.cache_key("pkg", "cpu", native=False)


def test_a_failed_build_leaves_no_cache_folder(wheel_cache, tmp_path):
    wheel_cache.FAIL = True
    with pytest.raises(subprocess.CalledProcessError):
        wheel_cache.main(["pkg==1.0"])
    assert not [p for p in (tmp_path / "cache").iterdir()]  # nor a half-written temporary folder
    wheel_cache.FAIL = False
    wheel_cache.calls.clear()
    wheel_cache.main(["pkg==1.0"])  # the next set-up builds it
    assert [args[0] for args, _ in wheel_cache.calls] == ["download", "wheel", "install"]
