"""A user-defined op for the qualified-name tests."""
import torch


def scaled_tanh(x):
    return torch.tanh(x) * 2


def stochastic_depth(x, p, mode, training=True):
    """Stands in for torchvision.ops.stochastic_depth (same qualified name, no torchvision needed)."""
    if not training or p == 0.0:
        return x
    keep = (torch.rand(x.shape[0], *([1] * (x.dim() - 1))) > p).to(x.dtype)
    return x * keep / (1 - p)


stochastic_depth.__module__ = "torchvision.ops.stochastic_depth"
torch.fx.wrap("stochastic_depth")  # as torchvision does: one call_function node
