"""Reports name the code that produced them, and say when the tree was not exactly that commit."""

import subprocess

from common.provenance import git_revision


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_git_revision_marks_a_changed_tree_dirty(tmp_path):
    assert git_revision(tmp_path) is None  # not a checkout
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / ".gitignore").write_text("runs/\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                         text=True).stdout.strip()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "report.json").write_text("{}")  # ignored outputs leave it clean
    assert git_revision(tmp_path) == sha
    (tmp_path / "new_module.py").write_text("y = 2\n")  # untracked code
    assert git_revision(tmp_path) == sha + "-dirty"
    (tmp_path / "new_module.py").unlink()
    (tmp_path / "code.py").write_text("x = 2\n")  # modified code
    assert git_revision(tmp_path) == sha + "-dirty"
