"""What the passes share: :class:`PassContext`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..policy import Policy


@dataclass
class PassContext:
    """What the passes share: the policy and facts about this conversion."""

    policy: Policy
    device: str = "cpu"
    prefix: str = ""  # module path of the converted region inside the user's model
    leaves: dict[str, str] = field(default_factory=dict)  # module path -> why it is a leaf
    regions: set[str] = field(default_factory=set)  # leaves that run eager with converted children
    has_shapes: bool = False
    symbols: Any = None  # shapes.Symbols: symbolic sizes and their ranges
    example_inputs: Any = None  # as given to convert (integrations read values: DGL's overflow guard)
