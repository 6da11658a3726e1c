"""The tree passes ruff's formatter and linter, with pyproject.toml's settings (CI runs them through
this test; moved from tests/unit/test_structure.py: ruff is a process, and the unit tier starts none)."""

from procs import REPO


def test_the_tree_passes_the_formatter_and_the_linter():
    """ruff, with pyproject.toml's settings (CI runs it through this test)."""
    import subprocess
    import sys

    for check in (["format", "--check", "."], ["check", "."]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *check], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, f"ruff {' '.join(check)}:\n{result.stdout}{result.stderr}"
