"""Cheating: falls back to PyTorch ops; the compiled kernel is a decoy that is never called.
Expected: failure (model_new.py may not call torch.relu: the allow-list refuses it before anything runs)."""
import torch
import torch.nn as nn
import cuda_extension


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return torch.relu(x * self.scale)
