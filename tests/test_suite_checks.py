"""The suite's own clean-tree check (tests/conftest.py): what counts as a test writing into the checkout."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from conftest import git_status, tree_files_written_since


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True,
                   env=dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                            GIT_COMMITTER_EMAIL="t@t"))


def test_a_write_anywhere_in_the_tree_is_seen_ignored_files_included(tmp_path):
    root = tmp_path / "checkout"
    (root / "src").mkdir(parents=True)
    (root / "src" / "module.py").write_text("x = 1\n")
    (root / ".gitignore").write_text("/runs/\n.venv/\n__pycache__/\n.pytest_cache/\n*.egg-info/\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "init")
    old = time.time() - 60
    for path in (root / "src" / "module.py", root / ".gitignore"):
        os.utime(path, (old, old))
    status = git_status(root)
    start = time.time() - 1.0

    assert tree_files_written_since(root, start) == [] and status == set()
    (root / "runs" / "wandb").mkdir(parents=True)  # git-ignored: invisible to git status
    (root / "runs" / "wandb" / "run.log").write_text("x")
    (root / "src" / "module.py").write_text("x = 2\n")  # tracked, modified
    (root / "new.txt").write_text("x")  # untracked
    for skipped in (".venv/lib", "src/__pycache__", ".pytest_cache", "unicon.egg-info"):
        (root / skipped).mkdir(parents=True)
        (root / skipped / "f").write_text("x")

    assert tree_files_written_since(root, start) == ["new.txt", "runs/wandb/run.log", "src/module.py"]
    assert git_status(root) - status == {" M src/module.py", "?? new.txt"}


def test_a_deleted_tracked_file_is_seen_by_git_status(tmp_path):
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "kept.txt").write_text("x")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "init")
    before = git_status(root)
    (root / "kept.txt").unlink()
    assert git_status(root) - before == {" D kept.txt"}


def test_git_status_outside_a_checkout_is_empty(tmp_path):
    assert git_status(tmp_path) == set()
