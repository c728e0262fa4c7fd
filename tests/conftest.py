"""Shared pytest fixtures. Tests never touch the network."""

import json
import sys
import os
import shutil
import subprocess
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# The suite must pass at any intra-op thread count (summation order changes with it):
# UNICON_TEST_THREADS=N runs it with N threads. ATEN_CPU_CAPABILITY (default, avx2, avx512) is read
# by torch itself at import and selects the vector kernels.
if os.environ.get("UNICON_TEST_THREADS"):
    torch.set_num_threads(int(os.environ["UNICON_TEST_THREADS"]))

EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture()
def fork_safe_threads():
    """Tests that fork worker processes run them with one intra-op thread: GNU OpenMP's thread pool
    does not survive fork(), and a forked child that enters a parallel region with more than one
    thread waits forever (seen with UNICON_TEST_THREADS > 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def float32_tol(n_reduce: int, scale: float = 1.0, depth: int = 1) -> float:
    """A forward-error bound for float32 results that two computations may round differently
    (another summation order: batching, thread count, vector width, masked vs absent inputs).

    A length-``n`` dot product in float32 is within ``n * eps * sum|x_i y_i|`` of the exact value
    (Higham, the γ_n bound); a value produced by ``depth`` such reductions in a row (layers) of
    magnitude ``scale`` accumulates at most ``depth * n * eps * scale`` this way, and two
    computations differ by at most twice that. Worst-case, machine-independent, and still orders of
    magnitude below what a wrong computation (a mask, an offset, a dropped token) changes.
    """
    return 2.0 * depth * n_reduce * EPS32 * max(scale, 1.0)

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("UNICON_SHARED_DIR", REPO.parent / "shared"))


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """``../shared`` beside the checkout (real benchmark files, papers, the OFA fixture)."""
    if not SHARED.is_dir():
        pytest.skip(f"needs the shared data directory {SHARED} (not present on this machine)")
    return SHARED


@pytest.fixture(scope="session")
def shared_data(shared_dir) -> Path:
    d = shared_dir / "data"
    if not d.is_dir():
        pytest.skip(f"needs {d} (real benchmark files)")
    return d


@pytest.fixture(scope="session")
def ofa_fixture_dir(shared_dir) -> Path:
    d = shared_dir / "fixtures" / "ofa-reference-tiny"
    if not (d / "model.safetensors").is_file():
        pytest.skip(f"needs the OFA reference fixture in {d}")
    return d


#: the shipped base model (scripts/ship_base_model.py) and the command that rebuilds it
SHIPPED_MODEL = REPO / "checkpoints" / "shapes_base"
DEMO_BASE_MODEL = REPO / "checkpoints" / "shapes_capgap_base"  # make demo's start, on the caption-gap world
REBUILD = "make pretrained"


@pytest.fixture(scope="session")
def shipped_world(tmp_path_factory) -> Path:
    """The world the shipped model was trained on: ``data/shapes`` when its fingerprint is the one in
    ``checkpoints/shapes_base/provenance.json``, else a world built here with the default options (whose
    fingerprint ``test_shipped_model`` checks)."""
    from unicon.worlds.shapes import load_world

    provenance = json.loads((SHIPPED_MODEL / "provenance.json").read_text())
    local = REPO / "data" / "shapes"
    if (local / "world.json").is_file() and load_world(local).fingerprint() == provenance["world"]["fingerprint"]:
        return local
    sys.path.insert(0, str(REPO))
    from data_builders.shapes import main as build_shapes
    root = tmp_path_factory.mktemp("shipped_world")
    assert build_shapes(["--out", str(root), "--quiet", "--overwrite", "--workers", "2"]) == 0
    return root


@pytest.fixture(scope="session")
def pretrained_shapes(shipped_world) -> tuple[Path, Path]:
    """``(export, world)`` of the shipped base model ``checkpoints/shapes_base`` and its world.

    ``$UNICON_PRETRAINED`` (a ``save_pretrained`` folder) and ``$UNICON_WORLD`` name another one. Under
    pytest-xdist the tests that use it run in one worker (:func:`pytest_collection_modifyitems`)."""
    if os.environ.get("UNICON_PRETRAINED"):
        export = Path(os.environ["UNICON_PRETRAINED"])
        world = Path(os.environ.get("UNICON_WORLD", REPO / "data" / "shapes"))
        if not (export / "unicon_model.json").is_file() or not (world / "cococon_test.json").is_file():
            pytest.skip(f"$UNICON_PRETRAINED={export} / world {world} is not a pretrained model and its world")
        return export, world
    return SHIPPED_MODEL, shipped_world


@pytest.fixture(scope="session")
def tiny_shapes_world(tmp_path_factory) -> Path:
    """A 12-scene ShapesWorld built by the real builder (tokenizer, mixture, CocoCon files)."""
    import sys

    sys.path.insert(0, str(REPO))
    from data_builders.shapes import main as build_shapes
    from standins import SMALL_INSTRUCT
    root = tmp_path_factory.mktemp("shapes")
    build_shapes(["--out", str(root), "--num-train", "12", "--num-val", "4", "--num-test", "4", "--quiet",
                  "--overwrite", "--num-ureason", "2", "--geneval-per-tag", "2", "--num-drift-seeds", "2",
                  "--num-reason-train", "0", *SMALL_INSTRUCT])
    return root


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)


@pytest.fixture(scope="session")
def chromium() -> str:
    """Path of a headless-capable Chromium for every browser test: Debian's ``chromium`` package,
    installed here with apt-get when it is missing (once per machine; no browser download). Skipped,
    with the reason, only where that is impossible (no apt-get, or not root)."""
    found = _chromium()
    if found:
        return found
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip("needs Chromium: not installed, and apt-get (as root) is not available to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    steps = (["apt-get", "update", "-qq"],
             ["apt-get", "install", "-y", "-qq", "-o", "DPkg::Lock::Timeout=300", "chromium"])
    for cmd in steps:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"needs Chromium: `{' '.join(cmd)}` failed ({e})")
        if proc.returncode:
            pytest.skip(f"needs Chromium: `{' '.join(cmd)}` exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    found = _chromium()
    if not found:
        pytest.skip("needs Chromium: apt-get installed the package but no chromium binary is on PATH")
    return found


# ---- running under pytest-xdist ---------------------------------------------------------------------
#: conftest fixtures too expensive to build once per worker: the tests using them share a worker
BUILT_ONCE = {"pretrained_shapes", "shipped_world"}
#: where the workers leave the units of work (test id -> unit) for the controller's scheduler
UNITS_FILE = "xdist-units.json"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Units of work for ``make test`` (``-n auto --dist loadgroup``), and the long ones first.

    Every test is its own unit, except that tests using the same module-, class- or session-scoped
    fixture of a test module (a trained run, a SLURM cluster, the README sandbox) or one of
    :data:`BUILT_ONCE` form one unit with them (transitively): the fixture is built once, and its
    tests run in file order in one worker, as in a serial run. Units holding a ``slow`` test are
    sent to the workers first, so that no worker is left alone with a long test at the end.

    Each worker collects the tests and writes ``{test id: unit}`` to :data:`UNITS_FILE` in the
    controller's tmp root, which :func:`pytest_xdist_make_scheduler` reads. (xdist's own
    ``xdist_group`` mark renames ``item._nodeid``, which pytest 9 no longer reads.)"""
    if not hasattr(config, "workerinput") or config.workerinput.get("unicon_units") is None:
        return
    parent: dict = {}

    def find(key):
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    keys = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        used = info.name2fixturedefs.items() if info else ()
        # The fixture function, not its name: a fixture imported into another module is the same one.
        # Autouse fixtures set up the environment: cheap, and they would join a whole module.
        keys[item] = [defs[-1].func for name, defs in used if defs and defs[-1].scope != "function"
                      and not getattr(defs[-1], "_autouse", False)
                      and (defs[-1].baseid.endswith(".py") or name in BUILT_ONCE)]
        for key in keys[item][1:]:
            parent[find(key)] = find(keys[item][0])
    groups: dict = {}
    for item in items:
        if keys[item]:
            groups.setdefault(find(keys[item][0]), []).append(item)
    unit = {item: item.nodeid for item in items}
    for root, members in groups.items():
        if len(members) > 1:
            for item in members:
                unit[item] = f"{members[0].path.name}::{root.__name__}"
    slow = {unit[item] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: unit[item] not in slow)  # stable: file order otherwise
    out = Path(config.workerinput["unicon_units"])
    tmp = out.with_name(f"{out.name}.{config.workerinput['workerid']}")
    tmp.write_text(json.dumps({item.nodeid: unit[item] for item in items}))
    os.replace(tmp, out)  # the workers collect the same tests: whichever lands last, the file is whole


def units_file(config) -> Path:
    """(controller) Where the workers leave the units of work: in the controller's tmp root."""
    return config._tmp_path_factory.getbasetemp() / UNITS_FILE


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(controller) Tell each worker where to write the units of work, under ``--dist loadgroup``."""
    config = node.config
    if config.getoption("dist") == "loadgroup":
        node.workerinput["unicon_units"] = str(units_file(config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """(controller) ``--dist loadgroup`` with the units of :func:`pytest_collection_modifyitems`, in
    the order the workers collected them (slow units first)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    units_path = units_file(config)

    class FixtureUnitScheduling(LoadScopeScheduling):
        units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:
                if not units_path.is_file():
                    raise RuntimeError(f"{units_path}: the workers wrote no units of work (tests/conftest.py)")
                self.units = json.loads(units_path.read_text())
            return self.units.get(nodeid, nodeid)

    config.option.loadscopereorder = False  # keep the collection order: slow units first
    return FixtureUnitScheduling(config, log)


# ---- the suite leaves the working tree as it found it, and says the peak disk its tmp root held -----
SKIPPED_IN_TREE = {".git", ".venv", "__pycache__", ".pytest_cache"}


def tree_files_written_since(root: Path, start: float) -> list[str]:
    """Files under ``root`` (git-ignored ones included) created or modified at or after ``start``,
    bytecode caches, pytest's cache, ``.git``, the virtual environment and ``*.egg-info`` left out."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_IN_TREE and not d.endswith(".egg-info")]
        for f in files:
            path = os.path.join(folder, f)
            try:
                if os.lstat(path).st_mtime >= start:
                    out.append(os.path.relpath(path, root))
            except FileNotFoundError:  # deleted meanwhile
                continue
    return sorted(out)


def git_status(root: Path) -> set[str]:
    """``git status --porcelain`` lines of ``root`` (modified, deleted and untracked files); empty
    outside a git checkout."""
    import subprocess

    proc = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=root,
                          capture_output=True, text=True)
    return set(proc.stdout.splitlines()) if proc.returncode == 0 else set()


def _size_mb(folder: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total / 2**20


class TmpDiskMeter:
    """The disk held under pytest's tmp root, sampled every ``every`` seconds in a daemon thread of the
    controller: its peak is what a run needs free. (``tmp_path_retention_policy = "failed"`` removes
    a passing test's ``tmp_path`` when it ends, and the whole root after a green run.)"""

    def __init__(self, config, every: float = 5.0):
        import threading

        self.config, self.every, self.peak, self.root = config, every, 0.0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tmp-disk-meter", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        root = getattr(getattr(self.config, "_tmp_path_factory", None), "_basetemp", None)
        if root is not None:
            self.root = root
            self.peak = max(self.peak, _size_mb(root))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def pytest_sessionstart(session):
    if hasattr(session.config, "workerinput"):  # the checks run once, in the controller
        return
    import time

    session.config._unicon_tree = (time.time() - 1.0, git_status(REPO))  # -1 s: coarse file-system clocks
    session.config._unicon_disk = TmpDiskMeter(session.config)


@pytest.hookimpl(tryfirst=True)  # before pytest's own sessionfinish removes the tmp root of a green run
def pytest_sessionfinish(session, exitstatus):
    """Fail the run when a test wrote into the checkout: every output belongs under pytest's tmp paths."""
    start = getattr(session.config, "_unicon_tree", None)
    if start is None:
        return
    session.config._unicon_disk.stop()
    since, status = start
    written, changed = tree_files_written_since(REPO, since), sorted(git_status(REPO) - status)
    session.config._unicon_tree_report = (written, changed)
    if written or changed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    written, changed = getattr(config, "_unicon_tree_report", ((), ()))
    if written or changed:
        terminalreporter.section("the tests changed the working tree", sep="=", red=True, bold=True)
        for line in [*(f"written: {p}" for p in written[:50]), *(f"git status: {s}" for s in changed[:50])]:
            terminalreporter.line(line)
        terminalreporter.line("tests write under pytest's tmp paths (tmp_path, tmp_path_factory), never into "
                              f"the checkout {REPO}")
    meter = getattr(config, "_unicon_disk", None)
    if meter is not None and meter.root is not None:
        terminalreporter.line(f"disk held under pytest's tmp root {meter.root}: peak {meter.peak:.0f} MB "
                              f"(sampled every {meter.every:.0f} s)")
