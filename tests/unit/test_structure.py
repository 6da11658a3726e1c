"""The shape the redesign promised: no import cycle in utils/, no argparse Namespace in the core,
a train.py that only sets up, and modules small enough to read in one sitting."""

import ast
import os
import re

from conftest import REPO

UTILS = os.path.join(REPO, "utils")
MOST_LINES = 450


def sources(*folders):
    for folder in folders:
        for name in sorted(os.listdir(os.path.join(REPO, folder))):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def utils_imports(path):
    """The utils modules that `path` imports, at any depth of the file (a function's import too)."""
    found = set()
    for node in ast.walk(ast.parse(open(os.path.join(REPO, path)).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("utils"):
            found |= {node.module.split(".")[1]} if "." in node.module else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("utils.")}
    return found


def test_no_import_cycle_in_utils():
    graph = {os.path.basename(p)[:-3]: utils_imports(p) for p in sources("utils")}
    done, path = set(), []

    def visit(module):
        assert module not in path, f"import cycle: {' -> '.join(path[path.index(module) :] + [module])}"
        if module in done:
            return
        path.append(module)
        for imported in graph.get(module, ()):
            visit(imported)
        path.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_the_core_takes_no_argparse_namespace():
    """Only utils/config.from_args reads the parsed command line; the core takes typed objects."""
    for path in sources("utils"):
        text = open(os.path.join(REPO, path)).read()
        if path.endswith("config.py"):
            text = text[: text.index("def from_args(")] + text[text.index("def check_init_method(") :]
        assert "getattr(args" not in text and not re.search(r"\bargs\.(?!setdefault)\w+", text), path


def test_algorithm_names_are_compared_only_in_the_factory():
    for path in [*sources("utils"), "train.py"]:
        if path.endswith("allreduce.py"):
            continue
        for line in open(os.path.join(REPO, path)):
            assert not re.search(r"""[=!]= *["'](two-pass|ring|gloo|hierarchical)["']""", line), (path, line)


def test_train_py_only_sets_up_and_modules_stay_small():
    assert sum(1 for _ in open(os.path.join(REPO, "train.py"))) <= 300
    for path in [*sources("utils"), "train.py"]:
        lines = sum(1 for _ in open(os.path.join(REPO, path)))
        assert lines <= MOST_LINES, f"{path} has {lines} lines"


def test_a_bad_command_line_and_the_launcher_need_no_torch():
    """torch takes a second or two to import: a bad command line, and the local launcher's checks,
    answer without it (every rank imports it where it starts training)."""
    import subprocess
    import sys

    light = "utils.config, utils.errors, utils.files, utils.launch, utils.mnist, utils.outputs, utils.stop"
    probe = (
        f"import sys; import {light}; import train; "
        f"code = train.main(['--lr', '-1']); print(code, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["2", "False"], (result.stdout, result.stderr)
    assert "--lr" in result.stderr
