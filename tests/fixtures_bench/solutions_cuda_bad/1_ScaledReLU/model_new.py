"""CUDA, cheating, workspace format: outputs cached by input pointer inside the C++ binding.
kernels/ are tests/env_cases/cuda/ops.cu + ops_binding.cpp byte for byte (one build shared with the env GPU tests).
Expected: failure (caught while timing)."""
import torch
import torch.nn as nn
import cuda_extension


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return cuda_extension.relu_scale_cached(x, self.scale)
