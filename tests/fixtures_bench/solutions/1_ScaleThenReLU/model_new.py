"""Known-good but slow: correct, yet it runs the (correct) kernel 256 times per call. The problem is tiny
(256 elements: eager PyTorch and torch.compile run it single-threaded in microseconds), so this is never
faster than either, whatever the machine's load. Expected: pass, not faster (reward 1)."""
import torch
import torch.nn as nn
import cuda_extension


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        for _ in range(256):
            y = cuda_extension.forward(x, self.scale)
        return y
