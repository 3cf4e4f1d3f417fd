import torch
import torch.nn as nn

BATCH = 64
DIM = 4096


class Model(nn.Module):
    """ReLU after a learnable per-feature scale: y = relu(x * scale)."""

    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return torch.relu(x * self.scale)


def get_inputs():
    return [torch.randn(BATCH, DIM)]


def get_init_inputs():
    return [DIM]
