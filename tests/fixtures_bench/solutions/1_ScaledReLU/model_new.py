"""Known-good but slow: correct, yet it runs the (correct) kernel 32 times per call, so it is never
faster than eager or torch.compile. Expected: pass, not faster (reward 1)."""
import torch
import torch.nn as nn
import cuda_extension


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        for _ in range(32):
            y = cuda_extension.forward(x, self.scale)
        return y
