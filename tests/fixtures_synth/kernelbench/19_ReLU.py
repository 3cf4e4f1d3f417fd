import torch
import torch.nn as nn


class Model(nn.Module):
    """Applies a ReLU activation (a KernelBench-format file written for synth.py's similarity test)."""

    def __init__(self):
        super(Model, self).__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


batch_size = 4096
dim = 16384


def get_inputs():
    x = torch.randn(batch_size, dim)
    return [x]


def get_init_inputs():
    return []
