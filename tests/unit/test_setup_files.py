"""requirements.txt and environment.yaml name the same packages and versions; the README's
test command is the one CI runs."""

import os
import re

import yaml
from conftest import REPO


def requirement_lines(lines):
    found = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            name = re.split(r"[=<>!~ ]", line, maxsplit=1)[0].lower()
            found[name] = line.replace(" ", "")
    return found


def test_requirements_and_conda_environment_agree():
    with open(os.path.join(REPO, "requirements.txt")) as f:
        pip = requirement_lines(f)
    with open(os.path.join(REPO, "environment.yaml")) as f:
        env = yaml.safe_load(f)
    assert env["name"] == "fl38"
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert requirement_lines(pip_section) == pip
    assert {"torch", "torchvision", "numpy", "tqdm"} <= set(pip)


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = [line.strip() for line in f if "pytest" in line and not line.lstrip().startswith("#")]
    assert len(ci) == 1
    command = ci[0]
    assert command in readme, command
