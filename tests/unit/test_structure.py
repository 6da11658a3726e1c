"""The shape the redesign promised: no import cycle in utils/, no argparse Namespace in the core,
a train.py that only sets up, and modules small enough to read in one sitting."""

import ast
import os
import re

from conftest import REPO

UTILS = os.path.join(REPO, "utils")
MOST_LINES = 450


def sources(*folders):
    """The .py files under `folders`, sub-packages included, as paths relative to the repository."""
    for folder in folders:
        for root, dirs, names in os.walk(os.path.join(REPO, folder)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(names):
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(root, name), REPO)


def module_of(path):
    """utils/comm/ring.py -> utils.comm.ring; utils/comm/__init__.py -> utils.comm."""
    parts = path[: -len(".py")].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def utils_imports(path, modules):
    """The utils modules that `path` imports, at any depth of the file (a function's import too)."""
    found = set()
    for node in ast.walk(ast.parse(open(os.path.join(REPO, path)).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "utils":
            for alias in node.names:  # `from utils.comm import ring` imports a module; `import Flags`, a name
                name = f"{node.module}.{alias.name}"
                found.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "utils"}
    return found


def test_no_import_cycle_in_utils():
    modules = {module_of(p): p for p in sources("utils")}
    graph = {m: utils_imports(p, modules) for m, p in modules.items()}
    assert {"utils.comm.ring", "utils.sync.interface", "utils.elastic.membership", "utils.run"} <= set(graph)
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


def test_the_program_s_modules_fit_300_lines_or_say_why():
    for path in sources("utils"):
        text = open(os.path.join(REPO, path)).read()
        assert text.count("\n") <= 300 or "Why this long:" in text.split('"""')[1], f"{path} is long and says not why"


def test_train_py_only_sets_up_and_modules_stay_small():
    assert sum(1 for _ in open(os.path.join(REPO, "train.py"))) <= 300
    for path in [*sources("utils", "bench", "scripts", "tests"), "train.py"]:
        lines = sum(1 for _ in open(os.path.join(REPO, path)))
        assert lines <= MOST_LINES, f"{path} has {lines} lines"


def test_a_bad_command_line_and_the_launcher_need_no_torch():
    """torch takes a second or two to import: a bad command line, and the local launcher's checks,
    answer without it (every rank imports it where it starts training)."""
    import subprocess
    import sys

    light = (
        "utils.setup.config, utils.errors, utils.store.files, utils.setup.launch, "
        "utils.learn.mnist, utils.store.outputs, utils.setup.stop"
    )
    probe = (
        f"import sys; import {light}; import train; "
        f"code = train.main(['--lr', '-1']); print(code, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["2", "False"], (result.stdout, result.stderr)
    assert "--lr" in result.stderr


def test_every_sync_kind_implements_the_one_interface():
    from utils.sync.buckets import OverlappedSync, PlainSync
    from utils.sync.interface import GradientSync
    from utils.sync.lazy import LazySync
    from utils.sync.periodic import PeriodicSync

    for kind in (PlainSync, OverlappedSync, LazySync, PeriodicSync):
        assert issubclass(kind, GradientSync) and not kind.__abstractmethods__, kind


def test_the_flags_travel_as_exact_numbers():
    from utils.sync.flags import Flags

    for flags in (Flags(), Flags(signalled=1), Flags(signalled=3, joining=True), Flags(joining=True)):
        assert Flags.from_sums(flags.values()) == flags and len(flags.values()) == 1
    summed = [a + b for a, b in zip(Flags(signalled=1).values(), Flags(signalled=1, joining=True).values())]
    assert Flags.from_sums(summed) == Flags(2, True)
    assert not Flags().stopping and Flags(signalled=2).stopping
    speeds = [a + b for a, b in zip(Flags(speeds=(0, 160)).values(), Flags(1, speeds=(255, 0)).values())]
    assert Flags.from_sums(speeds) == Flags(1, speeds=(255, 160)) and Flags.from_sums([]) == Flags()


def test_the_config_names_are_read_only_in_the_factories():
    """What depends on the kind of sum is asked of the object (has_rank_state, compressor.describe())."""
    factories = {"utils/setup/config.py", "utils/setup/cli.py", "utils/sync/factory.py", "utils/comm/compress.py"}
    for path in [*sources("utils"), "train.py"]:
        if path in factories:
            continue
        text = open(os.path.join(REPO, path)).read()
        assert not re.search(r"\.compress *[!=]=|== *[\"'](none|bf16|fp16|powersgd)[\"']", text), path
        assert not re.search(r"sync_every *[<>]", text), path
        assert "is NoCompression" not in text, path


def test_no_hidden_state_between_modules():
    """Mutable module state only where it is this process's own: the signal handler's (stop.py), the
    faults a test injects from the environment (faults.py) and the lock files held (outputs.py).
    The timeline, the membership and the host identity are handed to those who use them."""
    per_process = {"utils/setup/stop.py", "utils/elastic/faults.py"}
    for path in sources("utils"):
        tree = ast.parse(open(os.path.join(REPO, path)).read())
        uses_global = any(isinstance(node, ast.Global) for node in ast.walk(tree))
        assert not uses_global or path in per_process, path
        text = open(os.path.join(REPO, path)).read()
        writes = re.findall(r"os\.environ\[([^\]]+)\] *=|os\.environ\.setdefault\(([^,]+)", text)
        assert {a or b for a, b in writes} <= {'"GLOO_SOCKET_IFNAME"'}, (path, writes)  # gloo reads it
        assert "timeline.recorder" not in text and "recovery._membership" not in text, path


DRIVERS = (
    "allreduce/allreduce",
    "allreduce/pool_runs",
    "balance/balance",
    "balance/balance_pool",
    "balance/batch_cost",
    "balance/page_faults",
    "compute/compute",
    "fuzz/fuzz",
    "fuzz/control_cost",
    "recovery/recovery",
    "recovery/recovery_soak",
    "time_to_accuracy/time_to_accuracy",
    "train_step/train_step",
)


def test_no_sys_path_edits_outside_the_scripts_run_directly():
    """pyproject.toml gives pytest its pythonpath; tests/conftest.py gives it to the processes tests start."""
    # utils/setup/fork.py: a forked child's path, set as `python SCRIPT` would have it
    allowed = {"bench/common/harness.py", "scripts/cluster.py", "scripts/plot_metrics.py", "utils/setup/fork.py"}
    # the benchmarks run directly (python bench/<benchmark>/<driver>.py): bench/common/ on their path
    allowed |= {f"bench/{path}.py" for path in DRIVERS}
    for path in sources("utils", "tests", "bench", "scripts"):
        if path not in allowed and path != "tests/unit/test_structure.py":
            assert "sys.path" not in open(os.path.join(REPO, path)).read(), path
    assert "sys.path" not in open(os.path.join(REPO, "train.py")).read()


def test_the_tree_passes_the_formatter_and_the_linter():
    """ruff, with pyproject.toml's settings (CI runs it through this test)."""
    import subprocess
    import sys

    for check in (["format", "--check", "."], ["check", "."]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *check], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, f"ruff {' '.join(check)}:\n{result.stdout}{result.stderr}"


def test_the_sum_does_not_reach_up_to_the_command_line():
    """utils/comm and utils/sync take their names and defaults from utils/comm/names.py (torch-free),
    which the command line reads too: no arrow from the sum up to utils.setup.config or utils.setup.cli."""
    modules = {module_of(p): p for p in sources("utils")}
    for path in sources("utils/comm", "utils/sync"):
        assert not {"utils.setup.config", "utils.setup.cli"} & utils_imports(path, modules), path
    assert not re.search(r"^(import|from) ", open(os.path.join(REPO, "utils", "comm", "names.py")).read(), re.M)


def test_no_test_file_imports_another():
    """What tests share lives in helper modules (tests/procs.py, hosts.py, trace_checks.py...), not in test files."""
    for path in sources("tests"):
        tree = ast.parse(open(os.path.join(REPO, path)).read())
        for node in ast.walk(tree):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            assert not any(n.split(".")[-1].startswith("test_") for n in names), (path, names)


def test_the_measured_order_names_the_suite_s_files():
    """tests/durations.json (written by broad runs, read by tests/conftest.py to send the slowest files
    out first) holds seconds for test files that exist, and for most of them."""
    import json

    measured = json.load(open(os.path.join(REPO, "tests", "durations.json")))
    files = {os.path.basename(p) for p in sources("tests") if os.path.basename(p).startswith("test_")}
    assert set(measured) <= files and len(measured) >= 0.9 * len(files), sorted(files - set(measured))
    assert all(seconds >= 0 for seconds in measured.values())
