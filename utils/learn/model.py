"""The CNN: two 3x3 convolutions with max-pooling, then two fully connected layers.

Its layout is chosen for the CPU (measurements: bench/compute/NOTES.md): the convolutions'
weights are channels_last, so oneDNN runs both convolutions, forward and backward, in its
NHWC kernels without reordering, and
each pooling comes before its ReLU, so the ReLU and its backward touch a quarter of the values.
relu(max_pool(x)) equals max_pool(relu(x)) value for value (ReLU keeps order), and a saved model
evaluates the same either way. The MNIST images (N, 1, 28, 28) are channels_last as they are:
with one channel the two layouts are the same bytes.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    """28x28 -> conv 32 -> pool -> conv 64 -> pool -> fc 128 -> fc 10 (421,642 parameters).

    No dropout and no batch norm on purpose: nothing random happens inside the model and it
    has no buffers that ranks would have to keep in step, so every rank holds exactly the
    same model after every step, and a resumed run can repeat an uninterrupted one bit for bit.
    """

    def __init__(self, precision="fp32"):
        super().__init__()
        self.autocast = precision != "fp32"  # utils/setup/precision.py: bf16, forward and backward under autocast
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)
        self.to(memory_format=torch.channels_last)  # the 4-d weights: the convolutions'

    def forward(self, x):
        if self.autocast:  # the weights stay float32; autocast hands each layer a bf16 copy
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.layers(x).float()  # (the loss and its gradient in float32)
        return self.layers(x)

    def layers(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def parameter_vector(model):
    """Every parameter in one flat tensor, each in its logical (row-major) order whatever its
    layout: torch's parameters_to_vector views each, which a channels_last weight cannot be."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@torch.no_grad()
def load_parameter_vector(model, flat):
    """Copy `flat` (parameter_vector's order) into the parameters, each keeping its layout."""
    at = 0
    for p in model.parameters():
        p.copy_(flat[at : at + p.numel()].view(p.shape))
        at += p.numel()


def use_deterministic_algorithms():
    """torch.use_deterministic_algorithms(True), without its import of torch._inductor.

    The public call also sets the flag of torch.compile's inductor, which this program never uses,
    and so imports inductor (and dynamo with it), seconds of CPU at every start (measured:
    bench/compute/NOTES.md, "Start-up"). The flag the eager kernels read is the one set here;
    where this private call is missing (another torch), the public one does the same."""
    if hasattr(torch._C, "_set_deterministic_algorithms"):
        torch._C._set_deterministic_algorithms(True, warn_only=False)
    else:
        torch.use_deterministic_algorithms(True)
