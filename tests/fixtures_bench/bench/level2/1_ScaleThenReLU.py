import torch
import torch.nn as nn

BATCH = 4
DIM = 64


class Model(nn.Module):
    """A two-op chain: scale each feature, then ReLU. Test fixture (level 2 = fusion chains). Tiny on purpose:
    eager and torch.compile both run it single-threaded in microseconds, so their timings barely move with the
    machine's load (OpenMP regions do: a 2-core machine shared by many jobs makes them erratic)."""

    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        x = x * self.scale
        return torch.relu(x)


def get_inputs():
    return [torch.randn(BATCH, DIM)]


def get_init_inputs():
    return [DIM]
