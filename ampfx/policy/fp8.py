"""What ``fp8=`` asks for: the FP8 recipes, and the roofline that says where an FP8 GEMM pays.

A :class:`Recipe` says how the FP8 GEMMs of a linear layer scale their operands (the recipes are named as
torchao names its float8 training recipes); a :class:`Roofline` is the target device's peak GEMM rates and
memory bandwidth, from which the ``fp8:cost`` rule decides whether quantising a GEMM's operands costs more
than running it in FP8 saves (:func:`Roofline.pays`). Both are frozen; the Policy holds a preset's name or a
record of the user's, and :func:`recipe` / :func:`roofline` read either.

>>> recipe("rowwise").rowwise, roofline("h100").name
(True, 'h100')
>>> recipe("rowwse")
Traceback (most recent call last):
...
ampfx.errors.PolicyError: fp8='rowwse' is not an FP8 recipe: use 'tensorwise', 'rowwise' or 'rowwise_with_gw_hp' (or an ampfx.policy.fp8.Recipe), or None for no FP8. Did you mean 'rowwise'?
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..errors import PolicyError, did_you_mean
from ..ops.device_cost import ROOFLINES, Roofline  # noqa: F401 (the option names a device of the cost model)

HAS_FP8 = hasattr(torch, "float8_e4m3fn") and hasattr(torch, "float8_e5m2")
"""Does the installed torch have the FP8 dtypes (torch >= 2.1)?"""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How FP8 GEMMs scale their operands: ``rowwise`` (one scale per row along the reduced dimension) or one per
    tensor; ``weight_grad_high_precision``: the weight gradient GEMM runs in the operands' own dtype; the FP8
    dtypes of the forward operands and of the gradients (by name: ``"float8_e4m3fn"``, ``"float8_e5m2"``);
    ``power_of_2_scales``: each scale rounded up to a power of two (exact to multiply by); ``amax_history``: 0 for
    current scaling (each call scales by its operands' own amax), N for delayed scaling (tensorwise only): each call
    scales its input and output gradient by the largest amax of the layer's last N training calls, or by its own
    where that is larger (nothing is clipped), and its weight by its own (:class:`ampfx.runtime.fp8.AmaxHistory`).

    >>> Recipe("delayed", rowwise=False, amax_history=16).amax_history
    16
    """

    name: str
    rowwise: bool
    weight_grad_high_precision: bool = False
    forward: str = "float8_e4m3fn"
    backward: str = "float8_e5m2"
    power_of_2_scales: bool = False
    amax_history: int = 0

    def __post_init__(self) -> None:
        for which in ("rowwise", "weight_grad_high_precision", "power_of_2_scales"):
            if not isinstance(getattr(self, which), bool):
                raise PolicyError(f"Recipe {self.name!r}: {which}={getattr(self, which)!r}: use True or False")
        history = self.amax_history
        if isinstance(history, bool) or not isinstance(history, int) or history < 0:
            raise PolicyError(f"Recipe {self.name!r}: amax_history={history!r}: use 0 (current scaling) or the number "
                              "of calls whose amax delayed scaling keeps, e.g. 16")
        if history and self.rowwise:
            raise PolicyError(f"Recipe {self.name!r}: amax_history={history} with rowwise=True: delayed scaling keeps "
                              "one amax per tensor; use rowwise=False, or amax_history=0 (current scaling)")
        for which in ("forward", "backward"):
            value = getattr(self, which)
            if isinstance(value, torch.dtype):
                object.__setattr__(self, which, str(value).replace("torch.", ""))
            if getattr(self, which) not in ("float8_e4m3fn", "float8_e5m2"):
                raise PolicyError(f"Recipe {self.name!r}: {which}={value!r}: use 'float8_e4m3fn' or 'float8_e5m2'")

    def scaling(self, operand: str) -> tuple[torch.dtype, int | None, bool]:
        """How this recipe quantises ``operand`` of an FP8 linear layer's three GEMMs (:data:`OPERANDS`): its FP8
        dtype, the axis its scales run along (``None``: one scale for the tensor) and whether scales are powers of
        two. The one description the runtime (:mod:`ampfx.runtime.fp8`) and calibration
        (:mod:`ampfx.passes.calibrate`) both quantise by.

        >>> RECIPES["rowwise"].scaling("input"), RECIPES["tensorwise"].scaling("grad")
        ((torch.float8_e4m3fn, 1, True), (torch.float8_e5m2, None, False))
        """
        which, axis = OPERANDS[operand]
        return getattr(torch, getattr(self, which)), axis if self.rowwise else None, self.power_of_2_scales

    @property
    def spec(self) -> tuple[Any, ...]:
        """The recipe as a converted graph's code holds it (names, booleans): :func:`from_spec` reads it back."""
        return dataclasses.astuple(self)


OPERANDS: dict[str, tuple[str, int]] = {
    "input": ("forward", 1), "weight": ("forward", 1),  # x [M, K] @ w [N, K].T: both scaled along K
    "grad": ("backward", 1), "weight_t": ("forward", 0),  # g [M, N] @ w [N, K]: along N
    "grad_t": ("backward", 1), "input_t": ("forward", 0),  # g.T [N, M] @ x [M, K]: along M
}
"""Each operand of an FP8 linear layer's GEMMs: the recipe's dtype that quantises it (``forward`` or ``backward``)
and the axis of the tensor as the GEMM reads it along which a row-wise recipe keeps its scales."""


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("tensorwise", rowwise=False),
    Recipe("rowwise", rowwise=True, backward="float8_e4m3fn", power_of_2_scales=True),
    Recipe("rowwise_with_gw_hp", rowwise=True, weight_grad_high_precision=True, backward="float8_e4m3fn",
           power_of_2_scales=True))}
"""The recipes ``fp8=`` names, as torchao 0.18 defines its float8 training recipes: tensorwise e4m3 forward and e5m2
gradients; rowwise e4m3 throughout (a scale per row keeps the gradients' range) with power-of-two scales."""


def from_spec(spec: Any) -> Recipe:
    """The recipe a graph names: a preset's name, or a :attr:`Recipe.spec`."""
    return RECIPES[spec] if isinstance(spec, str) else Recipe(*spec)


def recipe(value: Any) -> Recipe | None:
    """The :class:`Recipe` ``fp8=`` asks for: a preset by name (any case), a Recipe, ``None`` / ``"off"`` / ``"none"``
    / ``""`` for none; a :class:`PolicyError` with a suggestion otherwise, or where torch has no FP8 dtypes."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "off", "none")):
        return None
    if isinstance(value, Recipe):
        if value.name in RECIPES and value != RECIPES[value.name]:
            raise PolicyError(f"fp8=Recipe({value.name!r}, ...) differs from the preset of that name: give your "
                              f"recipe a name of its own (the log and a converted graph name recipes by name), or use "
                              f"fp8={value.name!r}")
        found = value
    elif isinstance(value, str) and value.strip().lower() in RECIPES:
        found = RECIPES[value.strip().lower()]
    else:
        names = " or ".join(f"{n!r}" for n in RECIPES).replace(" or ", ", ", len(RECIPES) - 2)
        raise PolicyError(f"fp8={value!r} is not an FP8 recipe: use {names} (or an ampfx.policy.fp8.Recipe), or None "
                          f"for no FP8.{did_you_mean(str(value).strip().lower(), RECIPES)}")
    if not HAS_FP8:
        raise PolicyError(f"fp8={found.name!r}: this torch ({torch.__version__}) has no float8 dtypes "
                          "(torch.float8_e4m3fn, torch.float8_e5m2); FP8 needs torch >= 2.1. Convert without fp8=, or "
                          "upgrade torch.")
    return found


DEFAULT_ROOFLINE = "h100"
"""The target device when ``fp8_roofline`` is not given."""


def roofline(value: Any) -> Roofline | None:
    """The :class:`Roofline` ``fp8_roofline=`` names: a preset, a Roofline, ``None`` (not given) for
    :data:`DEFAULT_ROOFLINE`, ``"none"`` for no cost rule (``None`` returned)."""
    if value is None:
        return ROOFLINES[DEFAULT_ROOFLINE]
    if isinstance(value, str) and value.strip().lower() in ("none", "off"):
        return None
    if isinstance(value, Roofline):
        return value
    if isinstance(value, str) and value.strip().lower() in ROOFLINES:
        return ROOFLINES[value.strip().lower()]
    raise PolicyError(f"fp8_roofline={value!r}: use {', '.join(repr(n) for n in ROOFLINES)}, an "
                      "ampfx.policy.fp8.Roofline(name, bf16_tflops, fp8_tflops, bandwidth_tbs), or 'none' for no cost "
                      f"rule.{did_you_mean(str(value).strip().lower(), ROOFLINES)}")
