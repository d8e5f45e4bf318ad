"""A baseline commit's code beside this tree's, for benches that measure a change against
the code before it in the same rounds (``bench.front_end``, ``bench.controller_cost``).

A git worktree of the commit, checked out under a scratch folder. A process started with
that tree as its working directory imports the tree's packages with ``python -m`` (the
working directory comes first on ``sys.path``, before the editable install's finder); a
script run by path needs ``PYTHONPATH`` set to the tree as well.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def worktree(rev: str | None, scratch: Path) -> Iterator[Path | None]:
    """A git worktree of this repository at ``rev`` under ``scratch`` (None: none), removed
    on the way out."""
    if rev is None:
        yield None
        return
    tree = scratch / "baseline"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet",
                    str(tree), rev], check=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                       check=False)
