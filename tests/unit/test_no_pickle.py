"""Nothing a peer sends is unpickled (#32): no torch *_object collective, no pickle.load(s), and every
torch.load weights-only, in utils/, train.py and bench/. Peers' metadata goes as JSON and states as
torch.save archives read weights-only (utils/exchange.py); tests/world/test_exchange.py runs it."""

import ast
import os

from conftest import REPO


def sources():
    yield "train.py"
    for folder in ("utils", "bench"):
        for root, dirs, names in os.walk(os.path.join(REPO, folder)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            yield from (os.path.relpath(os.path.join(root, n), REPO) for n in sorted(names) if n.endswith(".py"))


def unpickling(path):
    """What in `path` unpickles a peer's bytes: (line, what) for each."""
    found = []
    for node in ast.walk(ast.parse(open(os.path.join(REPO, path)).read())):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name and (name.endswith("_object") or name.endswith("_object_list")):  # called, or handed on
            found.append((node.lineno, name))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in ("pickle", "cPickle", "_pickle", "dill") and node.attr in (
                "load",
                "loads",
                "Unpickler",
            ):
                found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "_pickle", "dill"):
            found += [
                (node.lineno, f"from {node.module} import {a.name}") for a in node.names if a.name != "UnpicklingError"
            ]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
            if isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                weights_only = [k.value for k in node.keywords if k.arg == "weights_only"]
                if not (weights_only and isinstance(weights_only[0], ast.Constant) and weights_only[0].value is True):
                    found.append((node.lineno, "torch.load without weights_only=True"))
    return sorted(found)


def test_nothing_a_peer_sends_is_unpickled():
    paths = list(sources())
    assert {
        "train.py",
        os.path.join("utils", "exchange.py"),
        os.path.join("bench", "train_step", "train_step_worker.py"),
    } <= set(paths)
    found = {p: unpickling(p) for p in paths}
    assert {p: f for p, f in found.items() if f} == {}


def test_the_check_sees_what_it_forbids(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle, torch\nimport torch.distributed as dist\n"
        "dist.all_gather_object(x, y)\ndist.broadcast_object_list(s, src=0)\nf(dist.all_gather_object)\n"
        "pickle.loads(b)\ntorch.load(p)\ntorch.load(p, weights_only=False)\ntorch.load(p, weights_only=True)\n"
        "e = pickle.UnpicklingError\n"
    )
    monkeypatch.setattr("test_no_pickle.REPO", str(tmp_path))
    assert sorted(line for line, _ in unpickling("bad.py")) == [3, 4, 5, 6, 7, 8]
