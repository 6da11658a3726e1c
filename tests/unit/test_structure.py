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
    faults a test injects from the environment (faults.py), the lock files held (outputs.py) and
    whether it told its --restart keeper that it trains (keeper.py).
    The timeline, the membership and the host identity are handed to those who use them."""
    per_process = {"utils/setup/stop.py", "utils/setup/keeper.py"}
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
    "heal/heal",
    "launcher/first_step",
    "recovery/recovery",
    "recovery/recovery_soak",
    "regression/regression",
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


def test_the_sum_does_not_reach_up_to_the_command_line():
    """utils/comm and utils/sync take their names and defaults from utils/comm/names.py (torch-free),
    which the command line reads too: no arrow from the sum up to utils.setup.config or utils.setup.cli."""
    modules = {module_of(p): p for p in sources("utils")}
    for path in sources("utils/comm", "utils/sync"):
        assert not {"utils.setup.config", "utils.setup.cli"} & utils_imports(path, modules), path
    assert not re.search(r"^(import|from) ", open(os.path.join(REPO, "utils", "comm", "names.py")).read(), re.M)


def imported(path):
    """The modules `path` imports, at any depth of the file, as written (`from a.b import c`: a.b)."""
    names = set()
    for node in ast.walk(ast.parse(open(os.path.join(REPO, path)).read())):
        names |= {node.module or ""} if isinstance(node, ast.ImportFrom) else set()
        names |= {a.name for a in node.names} if isinstance(node, ast.Import) else set()
    return names


def test_no_test_file_imports_another():
    """What tests share lives in tests/support/ (procs.py, hosts.py, trace_checks.py...), not in test files."""
    for path in sources("tests"):
        names = imported(path)
        assert not any(n.split(".")[-1].startswith("test_") for n in names), (path, names)


TIERS = ("unit", "world", "cluster", "bench")  # by how they run; tests/support/ holds what they share


def test_the_tests_are_filed_by_how_they_run():
    """Test files only in the tiers' folders, each name once (tests/durations.json and pytest's imports go
    by the file's name); tests/support/ holds helpers, workers and the fork server, and no test."""
    names = [os.path.basename(p) for p in sources("tests") if os.path.basename(p).startswith("test_")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for path in sources("tests"):
        folder, name = os.path.split(os.path.relpath(path, "tests"))
        if name.startswith("test_"):
            assert folder in TIERS, path
        elif folder == "support":
            tree = ast.parse(open(os.path.join(REPO, path)).read())
            tests = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
            assert not tests, (path, tests)
        else:
            assert name == "conftest.py" and folder in ("", "unit"), path
    assert not os.path.exists(os.path.join(REPO, "utils", "forkserver.py"))  # the tests' and benchmarks'


def test_the_unit_tier_starts_no_process():
    """tests/unit imports nothing that starts a process, nor calls os's process starters or names the
    interpreter to start (tests/unit/conftest.py also refuses a process at run time); a test that needs
    ranks, a worker, a probe or another program goes to tests/world."""
    starters = {"subprocess", "multiprocessing", "procs", "forker", "forkserver", "pty"}
    for path in sources("tests/unit"):
        if path.endswith("conftest.py"):
            continue  # (it imports subprocess to refuse it)
        names = imported(path)
        assert not {n for n in names if n.split(".")[-1] in starters or n.split(".")[0] in starters}, (path, names)
        for node in ast.walk(ast.parse(open(os.path.join(REPO, path)).read())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                said = f"{node.value.id}.{node.attr}"
                assert not re.fullmatch(
                    r"sys\.executable|os\.(fork\w*|system|popen|spawn\w*|exec\w*|posix_spawn\w*)", said
                ), (path, said)


def test_only_the_cluster_tier_needs_root_or_slurm():
    """Network namespaces, cgroup CPU quotas and Slurm's daemons (root) are tests/cluster's (and some
    benchmarks')."""
    for path in sources("tests/unit", "tests/world"):
        assert not {"netns", "cluster", "hosts", "slurm_cluster"} & imported(path), path
        if path != "tests/unit/test_structure.py":
            assert "needs_root" not in open(os.path.join(REPO, path)).read(), path


def test_the_measured_order_names_the_suite_s_files():
    """tests/durations.json (written by broad runs, read by tests/conftest.py to send the slowest files
    out first) holds seconds for test files that exist, and for most of them."""
    import json

    measured = json.load(open(os.path.join(REPO, "tests", "durations.json")))
    files = {os.path.basename(p) for p in sources("tests") if os.path.basename(p).startswith("test_")}
    assert set(measured) <= files and len(measured) >= 0.9 * len(files), sorted(files - set(measured))
    assert all(seconds >= 0 for seconds in measured.values())


def test_every_module_and_name_the_words_name_exists():
    """Every module, file, function or class that a docstring, comment, doc or note names in utils/,
    train.py, README.md, docs/ and bench/ (bench/results aside) exists where it says
    (tests/support/stale_references.py, which also runs alone over the tree)."""
    from stale_references import stale_references

    stale = stale_references()
    assert not stale, f"{len(stale)} stale references:\n" + "\n".join(stale)


def test_the_stale_reference_checker_knows_each_form(tmp_path):
    from stale_references import stale_references

    fine = (
        "utils/comm/ring.py utils/comm/ utils/comm/ring.ring_steps utils.comm.ring.Ring.landing utils/setup/config.Job "
        "utils.comm.ring bench/*/NOTES.md bench/results/compute/compute.{json,md} scripts/plot_metrics.py train.py "
        "tests/unit/test_structure.py::test_the_tests_are_filed_by_how_they_run (utils/learn/model.Net)."
    )
    stale = (
        "utils/memory.py utils/memory.MMAP_THRESHOLD utils.comm.ring.no_such utils/comm/ring.Ring.no_such "
        "utils/model.Net scripts/nothing.py bench/stats.compare tests/unit/test_structure.py::test_nothing "
        "utils.data.step_batches"
    )
    (tmp_path / "NOTES.md").write_text(f"{fine}\n{stale}\n")
    code = f'"""{fine}"""\n\n# {stale}\nNAMES = "utils.data utils/memory.py"  # (code, not words)\n'
    (tmp_path / "tool.py").write_text(code)
    found = stale_references([str(tmp_path / "NOTES.md"), str(tmp_path / "tool.py")])
    assert sorted(f.split(": ", 1)[1] for f in found) == sorted(stale.split() * 2), found
    assert all(f.startswith((f"{tmp_path}/NOTES.md:2: ", f"{tmp_path}/tool.py:3: ")) for f in found), found


def functions(path):
    """(name, lines from its def to its last line, docstring included) of every function in `path`."""
    tree = ast.parse(open(os.path.join(REPO, path)).read())
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree) if isinstance(n, kinds)]


def test_no_function_over_50_lines_and_the_run_s_over_30():
    """argparse's declarations (utils/setup/cli.make_parser) aside."""
    long = [
        f"{path}: {name} has {lines} lines"
        for path in [*sources("utils"), "train.py"]
        for name, lines in functions(path)
        if lines > (30 if path == "utils/run.py" else 50) and (path, name) != ("utils/setup/cli.py", "make_parser")
    ]
    assert not long, "\n".join(long)


USER_VARIABLES = {"RING_KEY_FILE", "RING_JOB_KEY"}  # what a user sets; what a test or a launcher hands:
HANDED_VARIABLES = {"RING_INSTRUMENTS", "RING_HANDOFF"}  # utils/observe/instruments.py, the handoff's message


def test_at_most_four_ring_variables():
    named = {
        name
        for path in [*sources("utils"), "train.py"]
        for name in re.findall(r"\bRING_[A-Z_]+", open(os.path.join(REPO, path)).read())
    }
    assert named <= USER_VARIABLES | HANDED_VARIABLES, sorted(named - USER_VARIABLES - HANDED_VARIABLES)


def project_classes():
    """{name: ClassDef} of every class in utils/."""
    return {
        n.name: n
        for path in sources("utils")
        for n in ast.walk(ast.parse(open(os.path.join(REPO, path)).read()))
        if isinstance(n, ast.ClassDef)
    }


def name_of(node):
    """What an expression is called by: `f` of f or of a.f; "" for anything else."""
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def base_names(node):
    return [name_of(b) for b in node.bases]


def test_no_class_is_made_of_two_of_the_project_s_classes():
    classes = project_classes()
    mixed = {name: bases for name, node in classes.items() if len(bases := set(base_names(node)) & set(classes)) > 1}
    assert not mixed, mixed


def exception_classes(classes):
    """The project's exceptions: classes whose bases lead to an Exception or BaseException."""
    found, grew = {"Exception", "BaseException"}, True
    while grew:
        more = {name for name, node in classes.items() if set(base_names(node)) & found}
        found, grew = found | more, bool(more - found)
    return found


def exception_attributes_set(text, exceptions):
    """["line: what"] where `text` sets an attribute of an exception outside the exception's own class:
    `error.x = ...` or setattr(error, ...) on a name bound by `except ... as error` or by making one of
    `exceptions` (error = PeerError(...)) in the same function or class or module."""
    found = []
    for scope in ast.walk(ast.parse(text)):
        if not isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(scope, ast.ClassDef) and scope.name in exceptions:
            continue
        errors = {h.name for h in ast.walk(scope) if isinstance(h, ast.ExceptHandler) and h.name}
        for node in ast.walk(scope):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and name_of(node.value.func) in exceptions
            ):
                errors |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(scope):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) in errors:
                    found.append(f"{node.lineno}: {ast.unparse(target)} = ...")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
                if getattr(node.args[0], "id", None) in errors:
                    found.append(f"{node.lineno}: setattr({ast.unparse(node.args[0])}, ...)")
    return sorted(set(found))


def test_no_attribute_of_an_exception_is_set_outside_its_class():
    """An exception's meaning is given when it is made (utils/errors.py's Outcome), not set on it in flight."""
    exceptions = exception_classes(project_classes())
    assert {"PeerError", "UsageError"} <= exceptions
    for path in [*sources("utils"), "train.py"]:
        found = exception_attributes_set(open(os.path.join(REPO, path)).read(), exceptions)
        assert not found, (path, found)
    sample = (
        "def f():\n    try:\n        g()\n    except OSError as e:\n        e.final = True\n"
        "    error = PeerError('lost')\n    error.resumable = False\n    setattr(error, 'x', 1)\n"
        "    other = Thing()\n    other.final = True\n"
        "class PeerError(Exception):\n    def __init__(self):\n        self.final = False\n"
    )
    assert exception_attributes_set(sample, exceptions) == [
        "5: e.final = ...",
        "7: error.resumable = ...",
        "8: setattr(error, ...)",
    ]


def calls(path, name):
    """The lines of `path` that call something named `name` (a function, or a method of anything)."""
    tree = ast.parse(open(os.path.join(REPO, path)).read())
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and name in (getattr(n.func, "attr", None), getattr(n.func, "id", None))
    ]


def test_only_the_training_state_loads_state_dicts():
    """train.py, utils/run.py and utils/elastic/ restore nothing themselves: the training state does."""
    for path in ["train.py", "utils/run.py", *sources("utils/elastic")]:
        assert not calls(path, "load_state_dict"), (path, calls(path, "load_state_dict"))


def test_the_loop_imports_neither_the_fault_injector_nor_the_keeper():
    modules = {module_of(p): p for p in sources("utils")}
    found = utils_imports("utils/run.py", modules) | imported("utils/run.py")
    banned = {"utils.elastic.faults", "utils.observe.instruments", "utils.setup.keeper"}
    assert not found & banned, found & banned
