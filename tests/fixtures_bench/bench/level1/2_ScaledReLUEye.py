import torch
import torch.nn as nn

BATCH = 4
DIM = 4096


class Model(nn.Module):
    """y = relu(x * scale) @ I. Test fixture: building the 64 MB identity and the matmul make the reference
    thousands of times more work than the answer needs, eager and torch.compile alike, so an honest fused kernel
    is reliably > 5% faster, even when timings are noisy."""

    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        y = torch.relu(x * self.scale)
        return y @ torch.eye(y.shape[1], device=y.device, dtype=y.dtype)


def get_inputs():
    return [torch.randn(BATCH, DIM)]


def get_init_inputs():
    return [DIM]
