import torch
import torch.nn as nn

ROWS, COLS = 8, 131072  # every probability is below 1e-4: far below atol = 1e-2


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.softmax(x, dim=-1)


def get_inputs():
    return [torch.rand(ROWS, COLS)]


def get_init_inputs():
    return []
