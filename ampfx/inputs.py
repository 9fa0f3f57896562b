"""Example inputs: the one place that knows the tuple / dict / single-value convention."""
from __future__ import annotations

import copy
from typing import Any

import torch.nn as nn


def snapshot(value: Any) -> Any:
    """A deep copy of ``value`` that later in-place changes cannot reach (the value itself if uncopyable)."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - uncopyable objects: keep the live reference
        return value


def call_with(module: nn.Module, example_inputs: Any) -> Any:
    """``module`` called on ``example_inputs`` (a tuple of positional inputs, a dict of keyword inputs, or one value)."""
    if isinstance(example_inputs, dict):
        return module(**example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return module(*example_inputs)
    return module(example_inputs)
