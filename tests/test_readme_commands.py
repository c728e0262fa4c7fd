"""Every command of the README and of the reference pages (``docs/*.md``) runs, as written, in a
sandbox project folder.

The sandbox has the documented relative layout (``data/shapes``, ``checkpoints/...``,
``../shared`` beside it). Real checkpoints and absolute paths the commands name are stand-ins of
the same format (``tests/standins.py``): a tiny ShapesWorld, tiny trained exports, the OFA
reference fixture, random tiny Janus / OWLv2 / Qwen2-VL models. A command may get *extra*
arguments appended that only make it small (fewer steps, samples or generations); it is never
edited otherwise. A documented command missing from ``RUNS`` fails the test: every documented
command is run by some test. A command shown on several pages (the README's tour repeats some of
``docs/commands.md``) is one entry of ``RUNS`` and runs once; ``RUNS``' order is the run order.
``docs/notebook/`` (dated notes) is not documentation of the current commands and is not read.

``make test`` is what CI runs; ``make demo`` has its own test below (the sandbox's world and
pretrained export exist, so it goes straight to the shortened demo run).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import standins
from conftest import DEMO_BASE_MODEL, SHIPPED_MODEL
from unicon.cli import main as unicon_main

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("UNICON_SHARED_DIR", REPO.parent / "shared"))

#: The pretraining recipe trains on two DDP ranks, which Lightning starts by running the command line
#: again (sys.argv): in-process here that would be pytest's, so these in-process runs keep one rank.
#: The recipe's own layout runs through the CLI in test_competence.
ONE_PROCESS = ("trainer.devices=1", "trainer.strategy=auto")

# documented command -> (extra arguments that only shrink it, expected exit code); where the command has
# a `--` (options, then config overrides), the extra arguments before their own `--` go before the
# command's, and the rest after it
RUNS: dict[str, tuple[list[str], int]] = {
    "unicon build-data shapes --out data/shapes": (
        ["--num-train", "12", "--num-val", "4", "--num-test", "4", "--num-ureason", "4", "--geneval-per-tag", "1",
         "--num-drift-seeds", "2", "--num-reason-train", "8", *standins.SMALL_INSTRUCT, "--quiet"], 0),
    "python -m unicon.embedders.clip --train-shapes data/shapes --out checkpoints/shapes_clip": (
        ["--steps", "3", "--batch-size", "8"], 0),
    "unicon train experiment=shapes_consistency loss.lambda_=0.25 trainer.max_epochs=3": (
        ["trainer.limit_train_batches=2", "eval.cococon.max_samples=4"], 0),
    "unicon train experiment=shapes_consistency model.lora.enabled=true trainer=gpu trainer.strategy=deepspeed_zero2": (
        [], 0 if torch.cuda.is_available() else 2),
    "unicon train resume=checkpoints/shapes_consistency/last.ckpt trainer.max_epochs=4": ([], 0),
    "unicon train experiment=shapes_reason": (["trainer.max_steps=2"], 0),
    "unicon experiment table2 --seeds 0 1 2 3 4 --out results/table2": (
        ["--seeds", "0", "--methods", "K", "M", "--", "trainer.max_epochs=1", "trainer.limit_train_batches=2",
         "eval.cococon.max_samples=4", "eval.drift.enabled=false", "eval.ureason.enabled=false"], 0),
    "unicon build-data shapes --out data/shapes_gap --caption-gap purple": (
        ["--num-train", "12", "--num-val", "4", "--num-test", "4", "--num-ureason", "4", "--geneval-per-tag", "1",
         "--num-drift-seeds", "2", "--num-reason-train", "4", *standins.SMALL_INSTRUCT, "--quiet"], 0),
    "unicon train experiment=shapes_pretrain name=shapes_gap_pretrain data.root=data/shapes_gap": (
        ["trainer.max_steps=2", *ONE_PROCESS], 0),
    "unicon experiment table2 --seeds 0 1 2 3 4 --methods K M --out results/table2_gap -- data.root=data/shapes_gap init_from=checkpoints/shapes_gap_pretrain/export eval.cococon.probe_words=[purple]": (
        ["--seeds", "0", "--", "trainer.max_epochs=1", "trainer.limit_train_batches=1", "eval.cococon.max_samples=4",
         "eval.cococon.generative=false"], 0),
    "unicon evaluate cococon --ckpt checkpoints/shapes_demo/export --data data/shapes/cococon_test.json --out outputs/cococon": (
        ["--logger", "none"], 0),
    "unicon evaluate cococon --ckpt checkpoints/pretrained/OFA-large --data ../shared/data/cococon/cococon.json --images /data/coco/val2014 --out outputs/cococon-coco": (
        ["--max-samples", "3", "--logger", "none", "--tasks", "vqa", "localization"], 0),
    "unicon evaluate drift   --ckpt checkpoints/shapes_demo/export --world data/shapes --generations 20 --out outputs/drift": (
        ["--generations", "2"], 0),
    "unicon evaluate drift   --ckpt checkpoints/pretrained/Janus-Pro-1B --seeds ../shared/data/geneval/evaluation_metadata.jsonl --detector owlv2:/models/owlv2 --clip /models/clip --out outputs/mgg": (
        ["--num-chains", "2", "--generations", "2", "--geneval-limit", "1"], 0),
    "unicon evaluate ureason --ckpt checkpoints/shapes_demo/export --data data/shapes --judge exact --out outputs/ureason": (
        ["--logger", "none"], 0),
    "unicon evaluate ureason --ckpt checkpoints/pretrained/Janus-Pro-7B --data ../shared/data/ureason --judge vlm:/models/Qwen3-VL-8B --out outputs/ureason-real": (
        ["--max-samples", "2", "--max-new-tokens", "8", "--judge-max-new-tokens", "4", "--logger", "none"], 0),
    "unicon evaluate shapes  --ckpt checkpoints/shapes_demo/export --world data/shapes --out outputs/shapes": (
        ["--limit", "4", "--logger", "none"], 0),
    "unicon evaluate shapes  --ckpt checkpoints/shapes_demo/export --world data/shapes --tasks edit --out outputs/shapes-edit": (
        ["--limit", "2", "--logger", "none"], 0),
    "unicon evaluate realunify --ckpt checkpoints/shapes_demo/export --data data/shapes --out outputs/realunify": (
        ["--limit", "1", "--logger", "none"], 0),
    "unicon evaluate all     --ckpt checkpoints/shapes_demo/export --out outputs/all eval=shapes": (
        ["eval.cococon.max_samples=4", "eval.drift.num_chains=2", "eval.drift.generations=1",
         "eval.drift.embedders=[scene]", "eval.ureason.max_samples=2"], 0),
    "unicon evaluate drift   --ckpt checkpoints/shapes_demo/export --world data/shapes --out outputs/drift-split --shard 0/2": (
        ["--generations", "2", "--logger", "none"], 0),
    "unicon evaluate drift   --ckpt checkpoints/shapes_demo/export --world data/shapes --out outputs/drift-split --shard 1/2": (
        ["--generations", "2", "--logger", "none"], 0),
    "unicon evaluate drift   --ckpt checkpoints/shapes_demo/export --world data/shapes --out outputs/drift-split --merge": (
        ["--generations", "2", "--logger", "none"], 0),
    "unicon evaluate alignment --ckpt checkpoints/shapes_demo/export --data data/shapes --clip checkpoints/shapes_clip --out outputs/alignment": (
        ["--limit", "4", "--logger", "none"], 0),
    "unicon evaluate editing --ckpt checkpoints/shapes_demo/export --data data/shapes/editscore/editscore.jsonl --out outputs/editing --own-edits 70": (
        ["--limit", "6", "--own-edits", "2", "--logger", "none"], 0),
    "unicon report checkpoints/shapes_demo": ([], 0),
    "unicon evaluate drift --ckpt checkpoints/shapes_base --world data/shapes --generations 20 --out outputs/drift-base": (
        ["--generations", "2", "--logger", "none"], 0),
    "unicon study create demo=outputs/drift base=outputs/drift-base --annotators 6 --overlap 2 --out outputs/study": (
        [], 0),
    "unicon study serve outputs/study": (["--port", "0", "--stop-after", "1"], 0),
    "unicon study export outputs/study": ([], 0),
    "unicon bench scoring": (["--samples", "4", "--k", "3"], 0),
    "unicon bench train": (["--steps", "2", "--warmup", "0", "--sequences", "8", "trainer.max_steps=2"], 0),
    "unicon bench chains": (["--repeats", "1", "--t2i-base-codes", "2", "--num-chains", "2", "--generations", "1"], 0),
    # one process: the recipe's two-rank measurement has its own test (test_training.py)
    "unicon bench pretrain": (["--steps", "1", "--warmup", "0", "data.batch_size=4", "trainer.devices=1"], 0),
    "unicon bench help": (["--repeats", "1", "--commands", "evaluate cococon", "report"], 0),
    "unicon bench first-batch": (["--repeats", "1", "--warmup", "0", "--max-samples", "2"], 0),
    "python -m unicon.data.shapes_coco export --world data/shapes --splits test": ([], 0),
    "unicon build-data cococon --captions data/shapes/coco/captions_test.json --questions data/shapes/coco/questions_test.json --annotations data/shapes/coco/vqa_annotations_test.json --instances data/shapes/coco/instances_test.json --images data/shapes --candidates vocab --lm none --out data/cococon_shapes": (
        ["--shards", "4", "--workers", "1", "--quiet"], 0),
    "python -m unicon.data.shapes_coco verify --world data/shapes --split test --cococon data/cococon_shapes/cococon.json": (
        [], 0),
    "unicon bench build-cococon": (["--pairs", "400", "--shards", "4", "--workers", "1"], 0),
}
NOT_HERE = {"make demo", "make test"}  # make test is CI itself; make demo: test_make_demo below


#: the pages whose bash blocks are documented commands: the README, then docs/*.md in name order
#: (not docs/notebook/)
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def page_commands(page: Path) -> list[str]:
    """Commands in one page's bash blocks (comments stripped, in order)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in block.splitlines():
            command = re.split(r"\s+#", line, maxsplit=1)[0].rstrip()
            if command.startswith(("unicon ", "python ", "make ")):
                out.append(command)
    return out


def documented_commands() -> list[str]:
    """Commands of the README and docs/*.md, page by page (a command shown on two pages twice)."""
    return [command for page in PAGES for command in page_commands(page)]


def test_every_documented_command_has_a_run():
    commands = documented_commands()
    assert set(commands) - NOT_HERE == set(RUNS), "documented commands without a test run (or stale entries)"
    for page in PAGES:
        shown = page_commands(page)
        assert len(shown) == len(set(shown)), f"{page.name} shows a command twice"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """``<tmp>/project`` with ``../shared`` beside it and the stand-ins in place of real checkpoints."""
    if not (SHARED / "data").is_dir():
        pytest.skip(f"needs the shared data directory {SHARED} (real benchmark files)")
    top = tmp_path_factory.mktemp("readme")
    proj = top / "project"
    proj.mkdir()
    (top / "shared").symlink_to(SHARED)
    fixture = SHARED / "fixtures" / "ofa-reference-tiny"
    pretrained = proj / "checkpoints" / "pretrained"
    pretrained.mkdir(parents=True)
    shutil.copytree(fixture, pretrained / "OFA-large")
    standins.janus_export(pretrained / "Janus-Pro-1B")
    shutil.copytree(pretrained / "Janus-Pro-1B", pretrained / "Janus-Pro-7B")
    standins.owlv2(top / "models" / "owlv2")
    shutil.copytree(SHIPPED_MODEL, proj / "checkpoints" / "shapes_base")  # tracked in the project, as on a clone
    shutil.copytree(DEMO_BASE_MODEL, proj / "checkpoints" / "shapes_capgap_base")
    standins.qwen2_vl(top / "models" / "Qwen3-VL-8B")
    return proj


def absolute(command: str, proj: Path) -> str:
    """The documented absolute paths (``/data``, ``/models``) moved under the sandbox's parent."""
    return re.sub(r"(?<=[ :])/(data|models)/", lambda m: f"{proj.parent}/{m.group(1)}/", command)


def coco_images(proj: Path, n: int) -> None:
    """Placeholder images for the first ``n`` samples of the real CocoCon file."""
    import json

    from PIL import Image

    data = json.loads((SHARED / "data" / "cococon" / "cococon.json").read_text())
    root = proj.parent / "data" / "coco" / "val2014"
    root.mkdir(parents=True, exist_ok=True)
    for image in data["images"]:
        Image.new("RGB", (64, 48), (120, 80, 40)).save(root / image["file_name"])


def with_extra(argv: list[str], extra: list[str]) -> list[str]:
    """``argv`` with the extra arguments of :data:`RUNS`: appended, except that on a command with a ``--``
    the extra arguments before their own ``--`` go before the command's (options, not overrides)."""
    if "--" in argv and "--" in extra:
        cut, own = argv.index("--"), extra.index("--")
        return [*argv[:cut], *extra[:own], *argv[cut:], *extra[own + 1:]]
    return [*argv, *extra]


def run(command: str, proj: Path, monkeypatch, capsys) -> str:
    extra, expected = RUNS[command]
    argv = with_extra(absolute(command, proj).split(), extra)
    monkeypatch.chdir(proj)
    if argv[0] == "python":
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=proj, capture_output=True, text=True,
                              timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == expected, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout
    code = unicon_main(argv[1:])
    out = capsys.readouterr()
    assert code == expected, f"{command}: exit {code}\n{out.out[-2000:]}\n{out.err[-2000:]}"
    if expected == 2:
        lines = [ln for ln in out.err.splitlines() if ln.strip()]
        assert len(lines) == 1 and "Traceback" not in out.err, out.err
    return out.out


@pytest.mark.slow
def test_readme_commands_run(sandbox, monkeypatch, capsys):
    proj = sandbox
    order = list(RUNS)
    build = order.pop(0)
    run(build, proj, monkeypatch, capsys)  # data/shapes, used by every command after it
    # what `make demo` does before the README's commands are useful: its world (small), then the demo run from
    # that world's shipped model
    monkeypatch.chdir(proj)
    assert unicon_main(["build-data", "shapes", "--out", "data/shapes_capgap", "--caption-gap", "purple",
                        "--caption-gap-keep", "0", *RUNS["unicon build-data shapes --out data/shapes"][0]]) == 0
    assert unicon_main(["train", "experiment=shapes_demo", "trainer.limit_train_batches=2", "eval.cococon.max_samples=4",
                        "eval.drift.num_chains=1", "eval.drift.generations=1", "eval.ureason.max_samples=2"]) == 0, \
        capsys.readouterr().err
    coco_images(proj, 3)
    for command in order:
        run(command, proj, monkeypatch, capsys)
        if command.startswith("python -m unicon.embedders.clip"):  # an open_clip directory for /models/clip
            shutil.copytree(proj / "checkpoints" / "shapes_clip", proj.parent / "models" / "clip")
    assert (proj / "checkpoints" / "shapes_consistency" / "last.ckpt").is_file()
    assert (proj / "outputs" / "drift" / "drift.json").is_file()
    assert (proj / "outputs" / "drift-split" / "drift.json").is_file()
    assert sorted(p.name for p in (proj / "outputs" / "all").iterdir()) == ["cococon", "drift", "ureason"]
    assert (proj / "checkpoints" / "shapes_demo" / "report.md").is_file()


#: lines that must not reach a `make demo` log: library warnings and tips, the java tokenizer's speed report,
#: a model-loading bar
DEMO_NOISE = re.compile(r"warn|deprecat|💡|srun|not empty|PTBTokenizer|Loading weights", re.I)


@pytest.mark.slow
def test_make_demo(sandbox, tmp_path):
    """``make demo`` with the sandbox's world in place (so it skips the build, as on a second run), starting
    from the shipped model, with shortened runs. M's run folder exists already (the README test's demo
    run), so the demo also shows that it replaces its own earlier runs. Each run (K, then M) prints its
    headline table, and the demo ends with M against K."""
    proj = sandbox
    if not (proj / "data" / "shapes" / "world.json").is_file():
        pytest.skip("needs the sandbox prepared by test_readme_commands_run")
    for name in ("Makefile", "constraints.txt", "pyproject.toml", "scripts"):
        if not (proj / name).exists():
            (proj / name).symlink_to(REPO / name)
    venv = REPO / ".venv"
    if not (venv / "bin" / "unicon").is_file():
        pytest.skip(f"needs the project's virtual environment {venv} (make setup)")
    args = ("trainer.limit_train_batches=2 eval.cococon.max_samples=4 eval.drift.num_chains=1 "
            "eval.drift.generations=1 eval.ureason.max_samples=2 logger=csv")
    # -o: never remake the project's venv from the sandbox (a stamp older than pyproject.toml would
    # otherwise reinstall it as an editable install of the sandbox, which has no src/)
    proc = subprocess.run(["make", "-o", str(venv / ".unicon-installed"), "demo", f"VENV={venv}", f"ARGS={args}"],
                          cwd=proj, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "report:" in out and "build-data" not in out
    # row K, then row M, each with its headline table above its paths; then M against K
    k_run, m_run = out.index("experiment=shapes_demo_control"), out.index("train experiment=shapes_demo ")
    assert k_run < out.index("CocoCon at the first and last", k_run) < out.index("checkpoint:", k_run) < m_run
    assert m_run < out.index("CocoCon at the first and last", m_run) < out.index("checkpoint:", m_run)
    tail = out[out.index("CocoCon at the last epoch end: shapes_demo (run) against shapes_demo_control (base)"):]
    assert all(f"\n{task} " in tail for task in ("vqa", "localization", "t2i")), tail
    # a log a newcomer can read: no library noise (unicon.cli.LIBRARY_NOISE, the java tokenizer's speed,
    # a loading bar), a missing CLIP named at most once, and it fits on two screens
    log = (proc.stdout + proc.stderr).splitlines()
    assert [line for line in log if DEMO_NOISE.search(line)] == []
    assert sum("no CLIP model" in line for line in log) <= 1 and len(log) <= 100, "\n".join(log)
    assert (proj / "checkpoints" / "shapes_demo" / "report.md").is_file()
    assert "Against the baseline run" in (proj / "checkpoints" / "shapes_demo" / "report.html").read_text()
