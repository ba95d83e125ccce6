"""A model factory an operator allows in the isolation tests."""

import torch.nn as nn


def tiny(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Embedding(32, width), nn.Linear(width, 32))
