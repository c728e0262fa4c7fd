"""Reliability of training runs: each test reproduces one finding.

* pickle only by consent: a ``.ckpt`` carrying an ``os.system`` payload is refused and runs nothing;
* one model truth: ``init_from`` + another ``model=`` is refused;
* resume is the same run: stored config + listed overrides; a kill -9 at a random step, then
  ``resume=``, gives the uninterrupted run's metrics, data order and weights;
* one run per folder: a lock and a refusal to reuse a folder;
* resume continues the newest state: an older checkpoint of the folder only with ``resume_older=true``,
  a checkpoint whose archive fails its CRC check never (nor by ``init_from`` or ``unicon evaluate``);
* a rerun of an evaluation into its ``--out`` replaces its metric and table rows;
* command-line group choices win over an experiment; a short run exits 0;
* bad values and files fail with exit code 2 and one line naming the key or file.

The runs use the real native OFA at a minimal size on a 12-scene ShapesWorld built by the real
builder, through ``unicon train`` in subprocesses (kill -9 needs a real process).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from standins import SMALL_INSTRUCT
from unicon.cli import main as unicon_main
from unicon.config import compose
from unicon.errors import UserError
from unicon.training.run import compose_run, train
from unicon.training.run_folder import claim_run_dir, release_run_dir

REPO = Path(__file__).resolve().parents[1]
TINY_OFA = [
    "model=ofa_shapes_tiny", "model.arch.d_model=32", "model.arch.encoder_layers=1", "model.arch.decoder_layers=1",
    "model.arch.encoder_attention_heads=2", "model.arch.decoder_attention_heads=2",
    "model.arch.encoder_ffn_dim=64", "model.arch.decoder_ffn_dim=64",
]


@pytest.fixture()
def world(tiny_shapes_world) -> Path:
    """conftest's 12-scene world, built by the real builder (read-only here)."""
    return tiny_shapes_world


def run_args(world: Path, out: Path, *extra: str) -> list[str]:
    return [*TINY_OFA, "trainer=cpu", "logger=csv", "eval=none", f"data.root={world}", f"output_dir={out}",
            "data.batch_size=4", "data.contrast_batch_size=2", "trainer.enable_progress_bar=false",
            "trainer.log_every_n_steps=1", "optim.lr=1e-3", "optim.warmup_ratio=0.0", "loss.gamma=0.5", *extra]


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONHASHSEED="0")
    e.pop("UNICON_DEBUG", None)
    return e


def unicon(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "unicon.cli", *args], capture_output=True, text=True, env=env(),
                          cwd=REPO, timeout=600, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"unicon {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock column."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        row.pop("time", None)
        out.append(row)
    return out


def one_line_error(capsys, code: int) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("unicon: error: "), err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# 1. pickle only by consent
# ---------------------------------------------------------------------------------------------
class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_with_pickle_payload_is_refused_and_runs_nothing(world, tmp_path, capsys):
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.ckpt"
    torch.save({"unicon_config": {"name": "x"}, "state_dict": {}, "payload": _Payload(marker)}, evil)
    out = tmp_path / "eval"
    code = unicon_main(["evaluate", "cococon", "--ckpt", str(evil), "--data", str(world / "cococon_test.json"),
                        "--out", str(out), "--logger", "none"])
    line = one_line_error(capsys, code)
    assert str(evil) in line and "allow_pickle" in line.replace("-", "_")
    code = unicon_main(["train", *run_args(world, tmp_path / "runs"), f"init_from={evil}"])
    line = one_line_error(capsys, code)
    assert str(evil) in line and "model.allow_pickle=true" in line
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# 2. init_from and model= describe one model
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tiny_shapes_world, tmp_path_factory) -> Path:
    """A 2-step run of the tiny OFA: its folder holds last.ckpt and export/."""
    out = tmp_path_factory.mktemp("trained")
    train(compose(run_args(tiny_shapes_world, out, "name=base", "trainer.max_steps=2")))
    return out / "base"


def test_init_from_with_another_model_is_refused(world, trained, tmp_path, capsys):
    for source in (trained / "export", trained / "last.ckpt"):
        code = unicon_main(["train", *run_args(world, tmp_path), "model=ofa_large", f"init_from={source}"])
        line = one_line_error(capsys, code)
        assert str(source) in line and "preset: 'ofa-large' vs 'shapes-tiny'" in line
        assert not (tmp_path / "run" / "last.ckpt").exists()
    # the same model section is accepted, and the saved config describes it
    result = train(compose(run_args(world, tmp_path, "name=ok", "trainer.max_steps=1", f"init_from={trained / 'export'}")))
    saved = json.loads((Path(result["export_dir"]) / "training_config.json").read_text())
    assert saved["model"]["preset"] == "shapes-tiny" and saved["model"]["arch"]["d_model"] == 32


# ---------------------------------------------------------------------------------------------
# 3. resume= starts from the stored config
# ---------------------------------------------------------------------------------------------
def test_resume_uses_the_checkpoint_config_and_lists_overrides(trained, capsys):
    cfg = compose_run([f"resume={trained / 'last.ckpt'}", "trainer.max_steps=4"])
    printed = capsys.readouterr().out
    assert cfg.name == "base" and cfg.optim.lr == pytest.approx(1e-3) and cfg.model.arch.d_model == 32
    assert cfg.output_dir == str(trained.parent) and cfg.resume == str(trained / "last.ckpt")
    assert "trainer.max_steps: 2 -> 4" in printed
    with pytest.raises(Exception, match="experiment= cannot be combined with resume="):
        compose_run([f"resume={trained / 'last.ckpt'}", "experiment=shapes_demo"])


def test_a_resume_in_a_moved_run_folder_keeps_last_ckpt_the_newest(world, tmp_path):
    """The checkpoint of a moved run folder names its old place; the resumed run still rewrites
    ``last.ckpt`` (no ``last-v1.ckpt``), so ``resume=<run>/last.ckpt`` never goes back."""
    import shutil

    train(compose(run_args(world, tmp_path / "old", "name=r", "trainer.max_steps=2", "trainer.max_epochs=1")))
    shutil.move(tmp_path / "old" / "r", tmp_path / "new" / "r")
    run = tmp_path / "new" / "r"
    result = train(compose_run([*run_args(world, tmp_path / "new", "name=r"), f"resume={run / 'last.ckpt'}",
                                "trainer.max_steps=3", "trainer.max_epochs=2"]))
    assert result["global_step"] == 3 and Path(result["ckpt_path"]) == run / "last.ckpt"
    assert sorted(p.name for p in run.glob("last*.ckpt")) == ["last.ckpt"]
    assert torch.load(run / "last.ckpt", weights_only=True)["global_step"] == 3


def test_resuming_an_older_checkpoint_is_refused_unless_resume_older(world, tmp_path, capsys):
    """``resume=`` of a checkpoint while another one in its folder holds a later step would go back
    and redo those steps: refused, naming both, unless ``resume_older=true`` (a choice of one command,
    checked at compose time and never taken over from a stored config)."""
    import shutil

    from unicon.config import ConfigError

    more = ["trainer.max_steps=2", "trainer.max_epochs=2"]
    train(compose(run_args(world, tmp_path, "name=r", "trainer.max_steps=1", "trainer.max_epochs=1")))
    run = tmp_path / "r"
    shutil.copy(run / "last.ckpt", run / "step1.ckpt")
    train(compose_run([f"resume={run / 'last.ckpt'}", *more], announce=False))
    capsys.readouterr()
    older = run / "step1.ckpt"
    line = one_line_error(capsys, unicon_main(["train", f"resume={older}", *more]))
    assert f"resume={older} is at step 1, but {run / 'last.ckpt'} in the same folder is at step 2" in line, line
    assert "resume_older=true" in line
    assert "metrics.jsonl's last training row is step 1: resuming last.ckpt continues after step 1" in line, line
    assert torch.load(run / "last.ckpt", weights_only=True)["global_step"] == 2  # nothing ran
    # a kill between the step-2 save and its row: the refusal shows the file one row behind
    metrics = run / "metrics.jsonl"
    kept = metrics.read_text()
    metrics.write_text("".join(ln + "\n" for ln in kept.splitlines()
                               if not ('"train/loss"' in ln and json.loads(ln)["step"] == 1)) + '{"step": 1, "tra')
    line = one_line_error(capsys, unicon_main(["train", f"resume={older}", *more]))
    assert "metrics.jsonl's last training row is step 0: resuming last.ckpt continues after step 1" in line, line
    metrics.write_text(kept)
    with pytest.raises(ConfigError, match="command line: resume_older=True applies only to a resume"):
        compose(["resume_older=true"])
    again = train(compose_run([f"resume={older}", "resume_older=true", *more], announce=False))
    assert again["global_step"] == 2 and [r["step"] for r in rows(run) if "train/loss" in r] == [0, 1]
    assert torch.load(run / "last.ckpt", weights_only=True)["unicon_config"]["resume_older"] is True
    assert compose_run([f"resume={run / 'last.ckpt'}"], announce=False).resume_older is False  # not inherited


# ---------------------------------------------------------------------------------------------
# 4. one run per folder
# ---------------------------------------------------------------------------------------------
def test_one_run_per_folder(world, trained, tmp_path):
    cfg = compose(run_args(world, tmp_path, "name=busy"))
    lock = claim_run_dir(cfg)
    try:
        with pytest.raises(UserError, match=r"in use by another unicon run \(pid \d+\)"):
            claim_run_dir(cfg)
    finally:
        release_run_dir(lock)
    # a finished run's folder is not reused by a plain re-run ...
    again = compose(run_args(world, trained.parent, "name=base", "trainer.max_steps=1"))
    with pytest.raises(UserError, match="already holds a run.*resume=.*overwrite=true"):
        train(again)
    # ... but overwrite=true replaces it
    scratch = tmp_path / "scratch"
    train(compose(run_args(world, scratch, "name=r", "trainer.max_steps=1")))
    (scratch / "r" / "stale.txt").write_text("old")
    train(compose(run_args(world, scratch, "name=r", "trainer.max_steps=1", "overwrite=true")))
    assert not (scratch / "r" / "stale.txt").exists() and (scratch / "r" / "last.ckpt").is_file()


def test_a_failed_start_does_not_block_the_corrected_retry(world, tmp_path, capsys):
    """A run that fails before its first checkpoint (a data.root without the training files) leaves
    its run folder; the corrected command reuses it. A folder no run claimed is still refused."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("tokenizer.json", "world.json"):
        (broken / name).write_bytes((world / name).read_bytes())
    with pytest.raises(UserError, match="not found"):
        train(compose(run_args(world, tmp_path, "name=r", "trainer.max_steps=1", f"data.root={broken}")))
    assert (tmp_path / "r" / "config.yaml").is_file() and not list((tmp_path / "r").glob("*.ckpt"))
    train(compose(run_args(world, tmp_path, "name=r", "trainer.max_steps=1")))
    assert (tmp_path / "r" / "last.ckpt").is_file()
    assert "stopped before its first checkpoint" in capsys.readouterr().out
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a run")
    with pytest.raises(UserError, match="already holds a run"):
        claim_run_dir(compose(run_args(world, tmp_path, "name=mine")))
    assert (tmp_path / "mine" / "notes.txt").is_file()


def test_only_rank_zero_touches_the_run_folder(world, tmp_path, monkeypatch):
    """Under DDP only global rank 0 creates the folder; another rank that gets there first must not
    write into it (a 2-rank SLURM job once failed with 'no such file: .../config.yaml' on rank 1)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from unicon.training.run_folder import write_run_config

    cfg = compose(run_args(world, tmp_path, "name=ranked"))
    run_dir = tmp_path / "ranked"
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert claim_run_dir(cfg) is None and not run_dir.exists()
    write_run_config(run_dir, cfg)  # rank 1: nothing to write, and no error for the missing folder
    assert not run_dir.exists()
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    lock = claim_run_dir(cfg)
    try:
        write_run_config(run_dir, cfg)
        assert "\nname: ranked\n" in "\n" + (run_dir / "config.yaml").read_text()
    finally:
        release_run_dir(lock)


# ---------------------------------------------------------------------------------------------
# 5. kill -9 at a random step, resume == uninterrupted (metrics, CSV, data order, weights)
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_kill9_then_resume_equals_uninterrupted_run(world, tmp_path):
    # 12 mixture rows / batch 4: the mixture loader cycles every 3 steps inside the (longer) contrast
    # epoch, so a resume has to continue both orders; a checkpoint every 2 steps
    common = ["trainer.max_epochs=3", "trainer.max_steps=12", "trainer.checkpoint_every_n_steps=2"]
    unicon("train", *run_args(world, tmp_path, "name=clean", *common))
    clean = tmp_path / "clean"

    kill_at = random.Random().randint(3, 9)  # a random step, reported on failure
    args = [sys.executable, "-m", "unicon.cli", "train", *run_args(world, tmp_path, "name=killed", *common)]
    proc = subprocess.Popen(args, env=env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        text = metrics.read_text() if metrics.is_file() else ""
        if any(json.loads(ln).get("step", -1) >= kill_at for ln in text.splitlines() if ln.endswith("}")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before step {kill_at}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with metrics.open("a") as f:  # a row cut in the middle, as a kill during a write leaves it
        f.write('{"step": 99, "train/lo')

    killed = tmp_path / "killed"
    resumed = unicon("train", f"resume={killed / 'last.ckpt'}", check=False)
    newer = re.search(r"but (\S+) in the same folder is at step", resumed.stderr)
    if newer:
        # killed between ModelCheckpoint's two saves of one step: the periodic file is newer than
        # last.ckpt and the resume is refused, naming it. Resuming that file continues training but
        # drops its step's metrics row (it is written before the step's metrics are logged), so the
        # run is continued from last.ckpt, as the refusal offers (resume_older=true)
        assert newer.group(1) != str(killed / "last.ckpt"), resumed.stderr
        resumed = unicon("train", f"resume={killed / 'last.ckpt'}", "resume_older=true", check=False)
    assert resumed.returncode == 0, f"kill at step {kill_at}:\n{resumed.stdout}\n{resumed.stderr}"
    assert rows(killed) == rows(clean), f"kill at step {kill_at}"
    csv_clean = (clean / "csv" / "metrics.csv").read_text()
    assert (killed / "csv" / "metrics.csv").read_text() == csv_clean, f"kill at step {kill_at}"
    a = torch.load(clean / "last.ckpt", weights_only=True)
    b = torch.load(killed / "last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"] == 12
    # same computation, same thread count, same binary: the weights are identical
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), (key, kill_at)
    report = unicon("report", str(killed))
    assert "report:" in report.stdout


def test_csv_resume_survives_a_header_rewrite_after_the_checkpoint(tmp_path):
    """Lightning's CSV writer rewrites ``metrics.csv`` under a wider header when a key first appears
    after a checkpoint; the resume keeps every row written before the checkpoint (it keeps lines,
    not a byte prefix that the rewrite has moved) and drops the later rows and a cut last line."""
    from types import SimpleNamespace

    from unicon.lightning_loggers import KeepingCSVLogger
    from unicon.training.log_files import LogFilesCallback

    def csv_logger():
        return KeepingCSVLogger(save_dir=str(tmp_path), name="csv", version="")

    logger = csv_logger()
    for step in range(3):
        logger.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
    trainer = SimpleNamespace(is_global_zero=True)
    checkpoint = {"global_step": 3}
    LogFilesCallback([logger]).on_save_checkpoint(trainer, None, checkpoint)
    before = (tmp_path / "csv" / "metrics.csv").read_text()
    logger.log_metrics({"train/loss": 0.2, "train/rho/vqa/epoch_mean": 0.5}, step=3)  # a new key: rewrite
    logger.log_metrics({"train/loss": 0.1}, step=4)
    logger.save()
    path = tmp_path / "csv" / "metrics.csv"
    rewritten = path.read_text()
    assert rewritten.splitlines()[0] != before.splitlines()[0]  # the rewrite moved every byte offset
    with path.open("a") as f:
        f.write("0,5,0.0")  # a row cut by the kill
    callback = LogFilesCallback([csv_logger()])
    callback.on_load_checkpoint(trainer, None, checkpoint)
    assert callback.dropped["csv"] == 3
    lines = path.read_text().splitlines()
    assert lines[0] == rewritten.splitlines()[0]
    assert [line.split(",") for line in lines[1:]] == [line.split(",") for line in rewritten.splitlines()[1:4]]
    assert len(lines) == len(before.splitlines())


def test_report_skips_and_counts_unreadable_lines(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "train/loss": 1.0}\n{"step": 1, "tra\nnot json\n'
                                       '{"step": 2, "train/loss": 0.5}\n')
    proc = unicon("report", str(run))
    assert "skipped 2 unreadable line(s)" in proc.stdout
    assert "report/unreadable_lines" in (run / "report.md").read_text()


# ---------------------------------------------------------------------------------------------
# 8. / 9. precedence and short runs
# ---------------------------------------------------------------------------------------------
def test_command_line_group_choice_beats_the_experiment():
    cfg = compose(["experiment=shapes_consistency", "eval=none"])
    assert not (cfg.eval.cococon.enabled or cfg.eval.drift.enabled or cfg.eval.ureason.enabled)
    assert cfg.loss.lambda_ == 4.0 and cfg.name == "shapes_consistency"  # the rest of the experiment stays
    assert compose(["experiment=shapes_consistency", "loss=hinge"]).loss.type == "hinge"


def test_run_shorter_than_the_logging_interval_exits_0(world, tmp_path):
    proc = unicon("train", *run_args(world, tmp_path, "trainer.max_steps=1", "trainer.log_every_n_steps=50"))
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and (tmp_path / "run" / "report.md").is_file()
    assert "report:" in proc.stdout


# ---------------------------------------------------------------------------------------------
# Reliability II: every bad value and file -> exit 2, one line naming the key or file
# ---------------------------------------------------------------------------------------------
BAD_VALUES = [
    ("loss.type=foo", "loss.type='foo' is not one of: spearman, hinge, none"),
    ("loss.gamma=2", "loss.gamma=2.0 is out of range: must be [0, 1]"),
    ("loss.lambda_=-1", "loss.lambda_=-1.0 is out of range: must be >= 0"),
    ("optim.lr=-1", "optim.lr=-1.0 is out of range: must be > 0"),
    ("optim.warmup_ratio=5", "optim.warmup_ratio=5.0 is out of range: must be [0, 1]"),
    ("optim.scheduler=bogus", "optim.scheduler='bogus' is not one of: linear, cosine, constant"),
    ("trainer.precision=bogus", "trainer.precision='bogus' is not one of"),
    ("data.batch_size=0", "data.batch_size=0 is out of range: must be >= 1"),
    ("loss.regularization=l3", "loss.regularization='l3' is not one of: l2, kl"),
    ("optim=adam", "optim is a config section without group files"),
    ("data.world=coco", "Key 'world' not in 'DataConfig'"),
    ("trainer.max_steps=0", "trainer.max_steps=0 is out of range: must be >= 1 (or -1)"),
    ("eval.drift.num_chains=-1", "eval.drift.num_chains=-1 is out of range"),
    ("loss=nope", "no config file"),
]


@pytest.mark.parametrize("override,expected", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_value_fails_at_compose_time_with_one_line(override, expected, capsys, tmp_path, monkeypatch):
    import unicon.models.factory

    def never(*a, **k):  # compose-time validation: no model may be built
        raise AssertionError("a model was built before the config was validated")

    monkeypatch.setattr(unicon.models.factory, "build_model", never)
    code = unicon_main(["train", override, f"output_dir={tmp_path}"])
    line = one_line_error(capsys, code)
    assert expected in line and "command line" in line, line


def test_bad_value_in_a_file_names_the_file(tmp_path, capsys, monkeypatch):
    configs = tmp_path / "configs"
    import shutil

    shutil.copytree(REPO / "configs", configs)
    (configs / "experiment" / "broken.yaml").write_text("loss:\n  gamma: 3\n")
    monkeypatch.setenv("UNICON_CONFIG_DIR", str(configs))
    line = one_line_error(capsys, unicon_main(["train", "experiment=broken"]))
    assert str(configs / "experiment" / "broken.yaml") in line and "loss.gamma=3" in line


def zero_bytes_in_a_tensor(ckpt: Path) -> Path:
    """Zero 8 bytes in the middle of the largest tensor record of a ``torch.save`` archive, in place
    (its CRC no longer matches; ``torch.load`` still loads it, with other weights)."""
    import struct
    import zipfile

    with zipfile.ZipFile(ckpt) as archive:
        record = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with ckpt.open("r+b") as f:
        f.seek(record.header_offset + 26)  # the local header: name and extra field lengths, then the data
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(record.header_offset + 30 + name_len + extra_len + record.file_size // 2)
        assert f.read(8) != bytes(8)
        f.seek(-8, 1)
        f.write(bytes(8))
    return ckpt


def _bad_files(world: Path, trained: Path, tmp: Path) -> list[tuple[str, list[str], str]]:
    """(id, unicon argv, the file or key the one line must name)."""
    ckpt = trained / "last.ckpt"
    data = ckpt.read_bytes()
    truncated = tmp / "truncated.ckpt"
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp / "random.ckpt"
    garbage.write_bytes(random.Random(0).randbytes(4096))
    export = tmp / "export-trunc-safetensors"
    import shutil

    shutil.copytree(trained / "export", export)
    st = export / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])
    export_tok = tmp / "export-trunc-tokenizer"
    shutil.copytree(trained / "export", export_tok)
    tok = next(p for p in export_tok.iterdir() if p.name.endswith("tokenizer.json"))
    tok.write_text(tok.read_text()[:200])
    bin_only = tmp / "export-bin-only"
    shutil.copytree(trained / "export", bin_only)
    from safetensors.torch import load_file

    torch.save(load_file(bin_only / "model.safetensors"), bin_only / "pytorch_model.bin")
    (bin_only / "model.safetensors").unlink()
    shutil.copytree(trained, tmp / "crc" / trained.name)  # a run folder whose last.ckpt has 8 bytes zeroed in a tensor
    bad_crc = zero_bytes_in_a_tensor(tmp / "crc" / trained.name / "last.ckpt")
    crc_failed = f"{bad_crc}: the checkpoint archive fails its integrity check (CRC of "
    metadata = trained / "export" / "unicon_model.json"  # a JSON file of a model directory, not a checkpoint
    out = str(tmp / "eval-out")
    cococon = lambda c: ["evaluate", "cococon", "--ckpt", str(c), "--data", str(world / "cococon_test.json"),  # noqa: E731
                         "--out", out, "--logger", "none", "--max-samples", "2"]
    return [
        ("truncated-ckpt", cococon(truncated), str(truncated)),
        ("random-ckpt", cococon(garbage), str(garbage)),
        ("truncated-safetensors", cococon(export), str(st)),
        ("truncated-tokenizer", cococon(export_tok), str(tok)),
        ("pickle-only-export", cococon(bin_only), "allow_pickle=true"),
        ("resume-export-folder", ["train", f"resume={trained / 'export'}"], str(trained / "export")),
        ("resume-missing", ["train", f"resume={tmp / 'nope.ckpt'}"], str(tmp / "nope.ckpt")),
        ("init-from-truncated", ["train", *run_args(world, tmp / "runs"), f"init_from={truncated}"], str(truncated)),
        ("resume-bad-crc", ["train", f"resume={bad_crc}", f"output_dir={tmp / 'crc'}"], crc_failed),
        ("init-from-bad-crc", ["train", *run_args(world, tmp / "runs"), f"init_from={bad_crc}"], crc_failed),
        ("evaluate-bad-crc", cococon(bad_crc), crc_failed),
        ("init-from-json", ["train", *run_args(world, tmp / "runs"), f"init_from={metadata}"],
         f"init_from: {metadata} is not a checkpoint; expected a Lightning .ckpt"),
        ("output-dir-is-a-file", ["train", *run_args(world, garbage)], str(garbage)),
    ] + ([] if torch.cuda.is_available() else [
        ("cuda-without-cuda", ["train", *run_args(world, tmp / "runs"), "trainer=gpu"], "trainer.accelerator=gpu"),
    ])


def test_bad_files_fail_with_one_line_naming_the_file(world, trained, tmp_path, capsys):
    for case, argv, named in _bad_files(world, trained, tmp_path):
        code = unicon_main(argv)
        line = one_line_error(capsys, code)
        assert named in line, (case, line)


def test_checkpoint_from_another_world_is_named(world, trained, tmp_path):
    from unicon.models import load_model

    ckpt = torch.load(trained / "last.ckpt", weights_only=True)
    ckpt.pop("unicon_world_files")
    foreign = tmp_path / "foreign.ckpt"
    torch.save(ckpt, foreign)
    other = tmp_path / "other-world"
    from data_builders.shapes import main as build_shapes

    build_shapes(["--out", str(other), "--num-train", "4", "--num-val", "2", "--num-test", "2", "--quiet",
                  "--overwrite", "--num-ureason", "1", "--geneval-per-tag", "1", "--num-drift-seeds", "1",
                  "--num-reason-train", "0", *SMALL_INSTRUCT])
    # a foreign world: its vocabulary has one more word (the model's embedding table no longer fits)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["zzforeignword"] = max(vocab.values()) + 1
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(UserError, match="another world") as err:
        load_model(foreign, world_root=other)
    assert str(foreign) in str(err.value)


def test_debug_flag_shows_the_traceback(capsys):
    with pytest.raises(UserError, match="loss.type='foo'"):
        unicon_main(["--debug", "train", "loss.type=foo"])


# ---------------------------------------------------------------------------------------------
# 6. / 7. drift outputs know their model; MGG scores the GenEval file it was given
# ---------------------------------------------------------------------------------------------
def test_drift_refuses_to_resume_another_models_chains(world, trained, tmp_path, capsys):
    from unicon.models import load_model

    other = tmp_path / "other-export"
    model = load_model(trained / "export")
    with torch.no_grad():
        next(model.parameters()).add_(0.5)
    model.save_pretrained(str(other))
    out = tmp_path / "drift"
    args = ["evaluate", "drift", "--world", str(world), "--generations", "1", "--embedders", "scene",
            "--geneval", "none", "--out", str(out)]
    assert unicon_main([*args, "--ckpt", str(trained / "export")]) == 0
    report = json.loads((out / "drift.json").read_text())
    assert report["checkpoint"] == str((trained / "export").resolve()) and len(report["model_fingerprint"]) == 32
    capsys.readouterr()
    line = one_line_error(capsys, unicon_main([*args, "--ckpt", str(other)]))
    assert "another model" in line and str(other.resolve()) in line and str((trained / "export").resolve()) in line
    assert json.loads((out / "drift.json").read_text()) == report  # nothing was overwritten
    assert unicon_main([*args, "--ckpt", str(trained / "export")]) == 0  # the same model resumes


def test_mgg_scores_the_geneval_file_given_as_seeds(world, trained, tmp_path):
    rows = [json.loads(line) for line in (world / "geneval_metadata.jsonl").read_text().splitlines()]
    mine = tmp_path / "evaluation_metadata.jsonl"
    mine.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    out = tmp_path / "mgg"
    assert unicon_main(["evaluate", "drift", "--ckpt", str(trained / "export"), "--world", str(world),
                        "--seeds", str(mine), "--generations", "1", "--embedders", "", "--out", str(out)]) == 0
    report = json.loads((out / "drift.json").read_text())
    assert report["geneval_file"] == str(mine.resolve())
    chains = json.loads((out / "mgg" / "run.json").read_text())["ids"]
    assert len(chains) == 2  # the two prompts of the given file, not the world's


def test_cococon_and_ureason_outputs_record_their_model(world, trained, tmp_path):
    from unicon.core import weights_fingerprint
    from unicon.models import load_model

    fp = weights_fingerprint(load_model(trained / "export"))
    ckpt = str(trained / "export")
    assert unicon_main(["evaluate", "cococon", "--ckpt", ckpt, "--data", str(world / "cococon_test.json"),
                        "--out", str(tmp_path / "c"), "--logger", "none", "--max-samples", "2",
                        "--no-generative"]) == 0
    results = json.loads((tmp_path / "c" / "results.json").read_text())
    assert results["model_fingerprint"] == fp and results["checkpoint"] == str(Path(ckpt).resolve())
    assert unicon_main(["evaluate", "ureason", "--ckpt", ckpt, "--data", str(world), "--judge", "exact",
                        "--out", str(tmp_path / "u"), "--logger", "none", "--max-samples", "1"]) == 0
    assert json.loads((tmp_path / "u" / "ureason.json").read_text())["model_fingerprint"] == fp


def test_the_same_evaluation_rerun_into_its_out_replaces_its_rows(world, trained, tmp_path):
    """The same command run twice into one ``--out`` is the same run (it goes on): the second writes
    each row of ``metrics.jsonl``, ``csv/metrics.csv`` and ``tables/*.jsonl`` in place of the first's,
    never a second row for a step (the loggers every suite makes: ``make_loggers(replace=True)``)."""
    ckpt = str(trained / "export")
    suites = {"cococon": ["--data", str(world / "cococon_test.json"), "--max-samples", "2", "--no-generative"],
              "ureason": ["--data", str(world), "--judge", "exact", "--max-samples", "1"]}
    for suite, args in suites.items():
        out = tmp_path / suite
        argv = ["evaluate", suite, "--ckpt", ckpt, *args, "--out", str(out), "--logger", "csv"]

        def logged() -> dict[str, int]:  # lines per file (timings differ between the runs)
            files = [out / "metrics.jsonl", out / "csv" / "metrics.csv", *sorted((out / "tables").glob("*.jsonl"))]
            return {str(f.relative_to(out)): len(f.read_text().splitlines()) for f in files}

        assert unicon_main(argv) == 0
        first = logged()
        assert len(first) >= 3 and all(first.values()), first
        assert unicon_main(argv) == 0
        assert logged() == first, suite


# ---------------------------------------------------------------------------------------------
# 10. SIGTERM during evaluation: stop, save, exit
# ---------------------------------------------------------------------------------------------
def test_sigterm_during_epoch_end_evaluation_saves_and_ends_the_run(world, tmp_path):
    from unicon.evaluation import preemption
    from unicon.evaluation.callbacks import SuiteCallback
    from unicon.evaluation.framework import EvalSuite, Outcome

    class SlowSuite(EvalSuite):
        name = "slow"
        batches = 0

        def load(self, config, args, root):
            return None

        def run(self, run):
            os.kill(os.getpid(), signal.SIGTERM)  # what SLURM sends before a kill
            for _ in range(10_000):  # an evaluation loop: one check per batch
                preemption.check()
                self.batches += 1
                time.sleep(0.01)
            return Outcome({})

    suite = SlowSuite()
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(preemption.Preempted) as err:
        train(compose(run_args(world, tmp_path, "trainer.max_steps=2", "trainer.max_epochs=1")),
              extra_callbacks=[SuiteCallback(suite, None)])
    assert suite.batches == 0 and err.value.signum == signal.SIGTERM
    ckpt = tmp_path / "run" / "last.ckpt"
    assert err.value.checkpoint == str(ckpt) and torch.load(ckpt, weights_only=True)["global_step"] == 2
    assert signal.getsignal(signal.SIGTERM) == before  # handlers are restored
    # the run resumes from it
    result = train(compose_run([*run_args(world, tmp_path), f"resume={ckpt}", "trainer.max_steps=3", "trainer.max_epochs=2"]))
    assert result["global_step"] == 3


@pytest.mark.slow
def test_sigterm_stops_a_standalone_evaluation_which_then_resumes(world, trained, tmp_path):
    args = [sys.executable, "-m", "unicon.cli", "evaluate", "drift", "--ckpt", str(trained / "export"),
            "--world", str(world), "--generations", "12", "--embedders", "scene", "--geneval", "none",
            "--batch-size", "1"]
    unicon(*args[3:], "--out", str(tmp_path / "clean"))
    out = tmp_path / "killed"
    proc = subprocess.Popen([*args, "--out", str(out)], env=env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (out / "mcd" / "text-first" / "gen-2.done.json").exists():
        time.sleep(0.02)
    assert proc.poll() is None, "the evaluation ended before it could be interrupted"
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and time.time() - sent < 30, err
    assert "preempted by signal SIGTERM" in err and "Traceback" not in err
    assert not (out / "drift.json").exists()
    unicon(*args[3:], "--out", str(out))  # resumes from the journals
    a, b = (json.loads((d / "drift.json").read_text()) for d in (tmp_path / "clean", out))
    assert a["MCD"] == b["MCD"] and a["mcd"] == b["mcd"]


# ---------------------------------------------------------------------------------------------
# Reliability II, evaluation commands: bad values, files, judges, devices, outputs, capabilities
# ---------------------------------------------------------------------------------------------
def _eval_cases(world: Path, trained: Path, tmp: Path) -> list[tuple[str, list[str], str]]:
    """(id, unicon argv, text the one error line must contain). ``--ckpt`` is a missing path where the
    check must come before any model is loaded."""
    export, missing = str(trained / "export"), str(tmp / "no-model")
    a_file = tmp / "a-file"
    a_file.write_text("x")
    data = json.loads((world / "cococon_test.json").read_text())
    bad_box, nan_box = tmp / "bad_box.json", tmp / "nan_box.json"
    for path, box in ((bad_box, [1e308, -5, 1e308, 3]), (nan_box, [float("nan"), 1, 2, 3])):
        d = json.loads(json.dumps(data))
        d["annotations"][0]["boxes"] = [box]
        path.write_text(json.dumps(d))
    coco = tmp / "coco"  # a 640x480 photo-like image where the world's renders were
    coco.mkdir()
    from PIL import Image

    for image in data["images"]:
        (coco / image["file_name"]).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (640, 480), (90, 120, 30)).save(coco / image["file_name"])
    cococon = ["evaluate", "cococon", "--data", str(world / "cococon_test.json"), "--logger", "none"]
    drift = ["evaluate", "drift", "--world", str(world), "--generations", "1", "--logger", "none"]
    ureason = ["evaluate", "ureason", "--data", str(world), "--judge", "exact", "--logger", "none"]
    out = ["--out", str(tmp / "out")]
    cases = [
        ("drift-num-chains", [*drift, "--ckpt", missing, *out, "--num-chains", "-1"], "--num-chains must be >= 1, got -1"),
        ("drift-generations", [*drift, "--ckpt", missing, *out, "--generations", "0"], "--generations must be >= 1"),
        ("cococon-batch", [*cococon, "--ckpt", missing, *out, "--batch-size", "0"], "--batch-size must be >= 1"),
        ("ureason-tokens", [*ureason, "--ckpt", missing, *out, "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        ("ureason-split-on-world", [*ureason, "--ckpt", missing, *out, "--split", "testmini"], "--split testmini"),
        ("ureason-judge-typo", ["evaluate", "ureason", "--data", str(world), "--judge", "exactt", "--ckpt", missing,
                                *out], "--judge 'exactt'"),
        ("ureason-judge-missing", ["evaluate", "ureason", "--data", str(world), "--judge", "vlm:/nonexistent",
                                   "--ckpt", missing, *out], "/nonexistent is not a local model directory"),
        ("cococon-box-huge", ["evaluate", "cococon", "--data", str(bad_box), "--ckpt", missing, *out],
         "lies outside any image"),
        ("cococon-box-nan", ["evaluate", "cococon", "--data", str(nan_box), "--ckpt", missing, *out],
         "non-finite coordinate"),
        ("cococon-no-image-left", [*cococon, "--ckpt", missing, *out, "--images", str(tmp / "out"), "--skip-missing"],
         "no sample left"),
        ("cococon-t2i-on-photos", [*cococon, "--ckpt", export, *out, "--images", str(coco), "--max-samples", "2"],
         "--tasks vqa localization"),
        ("drift-detector-missing", [*drift, "--ckpt", export, *out, "--detector", "owlv2:/nonexistent"],
         "/nonexistent"),
        ("drift-clip-missing", [*drift, "--ckpt", export, *out, "--clip", str(tmp / "no-clip")], str(tmp / "no-clip")),
    ]
    for suite in (cococon, drift, ureason):
        name = suite[1]
        cases.append((f"{name}-out-is-a-file", [*suite, "--ckpt", missing, "--out", str(a_file)], f"--out {a_file}"))
        cases.append((f"{name}-out-unwritable", [*suite, "--ckpt", missing, "--out", str(a_file / "sub")],
                      f"--out {a_file / 'sub'}: cannot write there"))
        if not torch.cuda.is_available():
            cases.append((f"{name}-cuda", [*suite, "--ckpt", missing, *out, "--device", "cuda"], "--device cuda"))
    return cases


def test_bad_evaluation_inputs_fail_early_with_one_line(world, trained, tmp_path, capsys):
    for case, argv, expected in _eval_cases(world, trained, tmp_path):
        line = one_line_error(capsys, unicon_main(argv))
        assert expected in line, (case, line)


def test_pickle_only_export_evaluates_with_allow_pickle(world, trained, tmp_path):
    import shutil

    from safetensors.torch import load_file

    export = tmp_path / "bin-only"
    shutil.copytree(trained / "export", export)
    torch.save(load_file(export / "model.safetensors"), export / "pytorch_model.bin")
    (export / "model.safetensors").unlink()
    assert unicon_main(["evaluate", "cococon", "--ckpt", str(export), "--data", str(world / "cococon_test.json"),
                        "--out", str(tmp_path / "o"), "--logger", "none", "--max-samples", "2", "--no-generative",
                        "--allow-pickle"]) == 0


def test_readme_drift_example_runs_without_a_trained_clip(world, trained, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)  # no checkpoints/shapes_clip here
    assert unicon_main(["evaluate", "drift", "--ckpt", str(trained / "export"), "--world", str(world),
                        "--generations", "2", "--geneval", "none", "--out", str(tmp_path / "d"), "--logger", "none"]) == 0
    assert "no CLIP model at the default" in caplog.text
    report = json.loads((tmp_path / "d" / "drift.json").read_text())
    assert "scene" in report["mcd"]["by_embedder"] and "clip" not in report["mcd"]["by_embedder"]


def test_any_garbage_checkpoint_is_a_one_line_error_naming_it(tmp_path):
    """Arbitrary bytes make torch's weights-only unpickler fail with whatever exception the opcodes
    it misreads raise (an IndexError from one CI run's os.urandom garbage, KeyError, struct.error,
    ...): every one must become the one-line UserError naming the file."""
    from unicon.errors import UserError
    from unicon.models import read_training_checkpoint

    for seed in range(200):
        rng = random.Random(seed)
        f = tmp_path / f"garbage-{seed}.ckpt"
        f.write_bytes(rng.randbytes(rng.randrange(1, 4096)))
        with pytest.raises(UserError, match=re.escape(str(f))):
            read_training_checkpoint(f)


# ---------------------------------------------------------------------------------------------
# Results files are strict JSON: a non-finite number is null (tables) or a string (metrics.jsonl)
# ---------------------------------------------------------------------------------------------
def test_tables_and_metrics_hold_no_bare_nan_or_infinity(tmp_path):
    import numpy as np
    from PIL import Image

    from unicon import jsonsafe
    from unicon.evaluation.logs import log_metrics, log_table
    from unicon.loggers import JsonlLogger

    loggers = [JsonlLogger(tmp_path)]
    rows = [[float("nan"), float("inf"), np.float32("-inf"), torch.tensor(float("nan")), 0.5, Image.new("RGB", (2, 2))],
            [[1.0, float("nan")], {"x": float("inf")}, "text", None, 2, None]]
    log_table(loggers, "suite/samples", ["a", "b", "c", "d", "e", "image"], rows, step=0)
    lines = (tmp_path / "tables" / "suite_samples.jsonl").read_text().splitlines()
    first, second = (jsonsafe.loads_strict(line) for line in lines)  # bare NaN / Infinity would raise
    assert [first[k] for k in "abcde"] == [None, None, None, None, 0.5] and first["image"].endswith(".png")
    assert second["a"] == [1.0, None] and second["b"] == {"x": None} and second["c"] == "text"
    log_metrics(loggers, {"suite/x": float("nan"), "suite/y": 1.5}, step=0)
    row = jsonsafe.loads_strict((tmp_path / "metrics.jsonl").read_text())
    assert row["suite/x"] == "nan" and row["suite/y"] == 1.5
    assert jsonsafe.finite({"C_k": {1: float("nan"), 2: float("inf")}, "rho": [float("-inf")]}) == \
        {"C_k": {1: None, 2: None}, "rho": [None]}
