"""CUDA, known-wrong, workspace format: scales by the first row of x.
kernels/ are tests/env_cases/cuda/ops.cu + ops_binding.cpp byte for byte (one build shared with the env GPU tests).
Expected: failure (values differ)."""
import torch
import torch.nn as nn
import cuda_extension


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return cuda_extension.relu_scale(x, x[0])
