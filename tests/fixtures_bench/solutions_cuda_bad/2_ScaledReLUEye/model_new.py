"""CUDA, cheating, workspace format: PyTorch fallback; the compiled kernels are decoys.
kernels/ are tests/env_cases/cuda/ops.cu + ops_binding.cpp byte for byte (one build shared with the env GPU tests).
Expected: failure (dispatch monitor)."""
import torch
import torch.nn as nn
import cuda_extension


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return torch.relu(x * self.scale)
