"""What a capture produced, and how capture errors are written in the report."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx


def short(e: BaseException) -> str:
    """An error as one line for the report: its type and the first line of its text."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:300]}"


@dataclass
class Capture:
    """What :func:`trace` produced and how."""

    graph: fx.Graph
    method: str  # "fx" | "fx, optional arguments fixed" | "export"
    leaves: dict[str, str] = field(default_factory=dict)  # module path -> trace error that made it a leaf
    fixed_args: dict[str, Any] = field(default_factory=dict)
    steps: list[str] = field(default_factory=list)
    mode_graphs: dict[bool, fx.Graph] | None = None  # export: the graph of each training mode, when they differ
    constants: dict[str, Any] = field(default_factory=dict)  # export: get_attr targets that are not the model's
    notes: list[str] = field(default_factory=list)
    mode_error: str | None = None  # export: why the other training mode could not be exported
