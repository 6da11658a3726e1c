"""What a fresh interpreter imports, each probed in a process of its own: training imports no
torch._dynamo (utils/learn/optim.py), the deterministic algorithms come on without torch._inductor,
and a bad command line and the local launcher's checks answer without torch. (Moved here from
tests/unit/test_optim.py, test_pure.py and test_structure.py: the unit tier starts no process.)"""

import subprocess
import sys


def test_training_imports_no_torch_dynamo():
    code = (
        "import sys, torch\n"
        "from utils.learn.model import Net\n"
        "from utils.learn.training import make_optimizer\n"
        "from utils.setup.config import Recipe\n"
        "model = Net()\n"
        "optimizer, scheduler = make_optimizer(model, Recipe(epochs=1), 10)\n"
        "model(torch.randn(2, 1, 28, 28)).sum().backward()\n"
        "optimizer.step(); scheduler.step(); optimizer.zero_grad()\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'sympy'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_deterministic_algorithms_are_on_without_importing_inductor():
    import subprocess
    import sys

    probe = (
        "import sys; import torch; from utils.learn.model import "
        "use_deterministic_algorithms as d; d(); "
        "print(torch.are_deterministic_algorithms_enabled(), 'torch._inductor' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60).stdout
    assert out.split() == ["True", "False"], out


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
