"""The checkouts bench/regression/regression.py measures: this one, or a worktree of an older commit
(--against), and what each one's command line offers (a ratio whose flags a tree lacks is skipped there)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from harness import REPO, LaunchError

# what a command must not inherit from our shell: the thread count (the launchers' own rule is measured) and
# our PYTHONPATH (a tree's modules come from its own folder); job_env drops every RING_* too (the launchers'
# handoff, the faults and pace instruments, the job's key)
STRIP = ("OMP_NUM_THREADS", "PYTHONPATH")


@dataclass(frozen=True)
class Tree:
    """A checkout whose train.py and scripts/cluster.py are run: this one, or --against's worktree."""

    label: str  # the short commit, as the table names it
    path: Path
    note: str  # "this checkout" (+ "with uncommitted changes"), or "--against"


def git(*args) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def this_tree() -> Tree:
    dirty = git("status", "--porcelain", "--untracked-files=no")  # (someone may be editing it as it runs)
    note = "this checkout" + (", with uncommitted changes" if dirty else "")
    return Tree(git("rev-parse", "--short", "HEAD"), REPO, note)


def add_worktree(commit: str, path: Path) -> Tree:
    """A detached worktree of `commit` at path; LaunchError if git does not know it or cannot make it."""
    try:
        label = git("rev-parse", "--short", "--verify", f"{commit}^{{commit}}")
        git("worktree", "add", "-q", "--detach", str(path), label)
    except subprocess.CalledProcessError as e:
        raise LaunchError(f"--against {commit}: {e.stderr.strip() or 'not a commit of this repository'}") from None
    return Tree(label, path, "--against")


def remove_worktree(path: Path) -> None:
    """Its files and git's record of it (whatever state a Ctrl-C left it in)."""
    if path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False)


def helps(tree: Tree) -> dict[str, str]:
    """The tree's --help texts, {"train": train.py's, "cluster": cluster.py train's} ('' if it has none):
    what its flags and their choices are, read before anything runs."""
    out = {}
    for kind, argv in (("train", ["train.py", "--help"]), ("cluster", ["scripts/cluster.py", "train", "--help"])):
        try:
            r = subprocess.run(
                [sys.executable, *argv], cwd=tree.path, env=job_env(), capture_output=True, text=True, timeout=60
            )
            out[kind] = r.stdout if r.returncode == 0 else ""
        except subprocess.TimeoutExpired:
            out[kind] = ""
    return out


def unsupported(cfg, help_text: dict[str, str]) -> str | None:
    """What of cfg's flags (a regression.Config's; or their values, where the flag has choices) the tree's
    help does not offer: "no --cpu", "no --compress powersgd"; None if it offers all."""
    for kind, args in (("cluster" if cfg.kind == "cluster" else "train", cfg.launch), ("train", cfg.train)):
        text = help_text[kind]
        if not text:
            return "no scripts/cluster.py train" if kind == "cluster" else "train.py --help failed"
        for i, word in enumerate(args):
            if not word.startswith("--"):
                continue
            if not re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text):
                return f"no {word}"
            choices = re.search(rf"{re.escape(word)} \{{([^}}]*)\}}", text)
            if choices and i + 1 < len(args) and args[i + 1] not in choices[1].split(","):
                return f"no {word} {args[i + 1]}"
    return None


def job_env() -> dict:
    """Our environment without the variables that would change what a command measures (STRIP, RING_*)."""
    return {k: v for k, v in os.environ.items() if k not in STRIP and not k.startswith("RING_")}
