import torch
import torch.nn as nn

BATCH = 16
DIM = 1024


class Model(nn.Module):
    """A two-op chain: scale each feature, then ReLU. Test fixture (level 2 = fusion chains)."""

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
