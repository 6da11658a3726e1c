"""Stale references: every module, file, function or class that the words of the repository name
must exist where they say. The words: utils/'s and train.py's comments and docstrings, README.md,
docs/, and bench/ (its notes, and its scripts' comments and docstrings; bench/results records what
was true on its day). The names: paths (utils/x/y.py, bench/*/NOTES.md, tests/unit/test_x.py::test_y,
scripts/...), dotted modules and names (utils.x.y, utils.x.y.Name), and a module's name after its
path (utils/x/y.name, utils/x.Name); a name must be defined in the module named, a method or
attribute after a class (utils.x.Name.attr) in that class.

    python tests/support/stale_references.py     # every stale reference, one a line (exit 1 if any)

tests/unit/test_structure.py holds the tree to none."""

import ast
import glob
import io
import os
import re
import sys
import tokenize

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sources(folder):
    """The .py files under `folder`, as paths relative to the repository."""
    for root, dirs, names in os.walk(os.path.join(REPO, folder)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        yield from (os.path.relpath(os.path.join(root, n), REPO) for n in sorted(names) if n.endswith(".py"))


PATH = re.compile(r"(?<![\w/.-])(?:utils|bench|scripts|tests|docs)/[\w./*-]*[\w*](?:::\w+)?|(?<![\w/.-])train\.py\b")
DOTTED = re.compile(r"(?<![\w./-])utils(?:\.[A-Za-z_]\w*)+")


def worded_files():
    """What says things in words: utils/ and train.py (their comments and docstrings), README.md, docs/
    and bench/ (its notes and its scripts' comments and docstrings; bench/results records its own day)."""
    found = [*sources("utils"), "train.py", "README.md"]
    for folder in ("docs", "bench"):
        for root, dirs, names in os.walk(os.path.join(REPO, folder)):
            dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "results"))
            found += [os.path.relpath(os.path.join(root, n), REPO) for n in sorted(names) if n.endswith((".py", ".md"))]
    return found


def words(path):
    """[(line number, text)]: a .py file's comments and docstrings, any other file's every line."""
    text = open(os.path.join(REPO, path)).read()
    if not path.endswith(".py"):
        return list(enumerate(text.splitlines(), 1))
    said = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(text).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                said += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return said


def defined(module_path, names):
    """Whether the module at `module_path` defines names[0] at its top level (a def, a class, an assignment;
    an import only in a package's __init__) and, if names[0] is a class, names[1] in its body or as self.x."""
    tree = ast.parse(open(os.path.join(REPO, module_path)).read())
    here = {}
    for node in tree.body:
        for inner in [node, *(getattr(node, "body", []) if isinstance(node, (ast.If, ast.Try)) else [])]:
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                here[inner.name] = inner
            elif isinstance(inner, (ast.Assign, ast.AnnAssign)):
                for target in inner.targets if isinstance(inner, ast.Assign) else [inner.target]:
                    here |= {n.id: inner for n in ast.walk(target) if isinstance(n, ast.Name)}
            elif isinstance(inner, (ast.Import, ast.ImportFrom)) and module_path.endswith("__init__.py"):
                here |= {(a.asname or a.name): inner for a in inner.names}
    if names[0] not in here:
        return False
    if len(names) == 1 or not isinstance(here[names[0]], ast.ClassDef):
        return True
    members = {n.name for n in ast.walk(here[names[0]]) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    members |= {n.id for n in ast.walk(here[names[0]]) if isinstance(n, ast.Name)}
    members |= {n.attr for n in ast.walk(here[names[0]]) if isinstance(n, ast.Attribute)}
    return names[1] in members


def resolves(parts):
    """Whether ["utils", "comm", "ring", "ring_steps"] names something that exists: the longest prefix that
    is a module or package, then what follows defined in it."""
    for cut in range(len(parts), 0, -1):
        base = os.path.join(REPO, *parts[:cut])
        module = base + ".py" if os.path.isfile(base + ".py") else os.path.join(base, "__init__.py")
        if os.path.isfile(module) or (cut == len(parts) and os.path.isdir(base)):
            return cut == len(parts) or defined(os.path.relpath(module, REPO), parts[cut:])
    return False


def path_exists(said):
    """utils/x/y.py, bench/*/NOTES.md, tests/unit/test_x.py::test_y, utils/x/y.name, utils/x.Name; under
    bench/results, a file's name may be cut where a template goes on (allreduce-<mode>.{json,md})."""
    said, _, test = said.rstrip("./").partition("::")
    if "**" in said:  # a pattern (.gitignore's), not a name
        return True
    if glob.glob(os.path.join(REPO, said) + ("*" if said.startswith("bench/results/") else "")):
        return not test or defined(said, [test])
    folder, _, last = said.rpartition("/")
    stem, *names = last.split(".")
    return not test and bool(names) and resolves([*folder.split("/"), stem, *names])


def stale_references(paths=None):
    """["file:line: name"] for every module, file, function or class that the words in `paths` (default:
    worded_files()) name and that does not exist where they say."""
    stale = []
    for path in worded_files() if paths is None else paths:
        for number, line in words(path):
            named = [(m, path_exists(m)) for m in PATH.findall(line)]
            named += [(m, resolves(m.split("."))) for m in DOTTED.findall(line)]
            stale += [f"{path}:{number}: {m}" for m, ok in named if not ok]
    return stale


if __name__ == "__main__":
    found = stale_references()
    print("\n".join(found) or "no stale reference")
    sys.exit(1 if found else 0)
