"""Which code produced a result: the git revision written into reports and manifests."""

from __future__ import annotations

import subprocess
from pathlib import Path


PROJECT_ROOT = Path(__file__).resolve().parent.parent


def git_revision(cwd: Path = PROJECT_ROOT) -> str | None:
    """The checked-out commit's short hash, with '-dirty' when the working tree differs from it
    (modified or untracked files that are not ignored): a report then says it did not come from
    that commit alone. None outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        sha = git("rev-parse", "--short", "HEAD")
        return sha + ("-dirty" if git("status", "--porcelain") else "")
    except (OSError, subprocess.SubprocessError):
        return None
