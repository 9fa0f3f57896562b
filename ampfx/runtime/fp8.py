"""FP8 GEMMs at run time: scaled quantisation, the three GEMMs of a linear layer, and the recipes.

A float tensor ``x`` is held in FP8 as ``q`` (``float8_e4m3fn`` for weights and activations, whose range is
+-448, or ``float8_e5m2`` for gradients, +-57344) with a float32 ``scale`` such that ``x ~ q * scale``:
one scale for the whole tensor (*tensorwise*) or one per row along the GEMM's reduction dimension (*rowwise*),
each ``amax / max of the FP8 dtype`` at the time of the call (current scaling). :func:`linear` runs a linear
layer's three GEMMs in FP8: the output ``x @ w.T``, the input gradient ``g @ w`` and the weight gradient
``g.T @ x``, each operand quantised along the dimension that GEMM reduces over; with a recipe's
``weight_grad_high_precision`` the last one runs in the operands' own dtype. Gradients reach ``x`` and ``w``
as if the quantisation were the identity (a straight-through estimate), and are returned in their dtypes.

:func:`scaled_mm` multiplies two quantised operands with ``torch._scaled_mm`` on a GPU; on a CPU, where that
kernel is a slow reference, it computes what the kernel computes, the float32 product of the dequantised
operands (``tests/test_fp8_runtime.py`` checks that the two agree), rounded to the output dtype; so it does on a
GPU for shapes the kernel refuses (a dimension that is not a multiple of 16).

>>> x, w = torch.randn(4, 32), torch.randn(16, 32)
>>> y = linear(x, w, None, RECIPES["tensorwise"])
>>> y.shape, bool((y - x @ w.T).norm() / (x @ w.T).norm() < 0.1)
(torch.Size([4, 16]), True)
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from ..policy.fp8 import HAS_FP8, RECIPES, Recipe, from_spec
from . import is_compiling

E4M3, E5M2 = (torch.float8_e4m3fn, torch.float8_e5m2) if HAS_FP8 else (None, None)


def quantize(x: torch.Tensor, dtype: torch.dtype, dim: int | None, power_of_2: bool = False,
             amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``x ~ q.float() * scale``: ``scale`` float32, one for the whole tensor (``dim=None``)
    or one per slice along ``dim`` (kept as a size-1 dimension), rounded up to a power of two with ``power_of_2``;
    made from ``amax`` where given (delayed scaling), else from ``x``'s own; values past the FP8 range saturate.

    >>> q, s = quantize(torch.tensor([[1.0, -448.0], [2.0, 0.5]]), E4M3, dim=1)
    >>> q.dtype, s.flatten().tolist()
    (torch.float8_e4m3fn, [1.0, 0.004464285913854837])
    >>> quantize(torch.tensor([[1.0, -448.0], [2.0, 0.5]]), E4M3, dim=1, power_of_2=True)[1].flatten().tolist()
    [1.0, 0.0078125]
    """
    top = torch.finfo(dtype).max
    if amax is None:
        amax = x.detach().abs().amax() if dim is None else x.detach().abs().amax(dim=dim, keepdim=True)
    scale = (amax.float() / top).clamp(min=torch.finfo(torch.float32).tiny)
    if power_of_2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (x.float() / scale).clamp(-top, top).to(dtype)
    return q, scale


def scaled_mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` of FP8 operands, in ``out_dtype``: ``a`` [M, K] with a scalar or [M, 1]
    scale, ``b`` [K, N] with a scalar or [1, N] scale. ``torch._scaled_mm`` on a GPU (rowwise scales into a float32
    result: the kernel writes bfloat16, widened after, as torchao's weight gradient does); on a CPU the float32
    product of the dequantised operands, which is what that kernel computes."""
    rowwise_fp32 = scale_a.numel() > 1 and out_dtype == torch.float32  # the rowwise kernels write 16 bits only
    kernel_out = torch.bfloat16 if rowwise_fp32 else out_dtype
    if a.is_cuda and _kernel_takes(a, scale_a, b, kernel_out):  # the kernel wants a row-major, b column-major
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=scale_a, scale_b=scale_b,
                                out_dtype=kernel_out).to(out_dtype)
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


def _kernel_takes(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Can ``torch._scaled_mm`` multiply these on a GPU: every dimension a multiple of 16, and a 16-bit output
    where the scales are per row (the GPUs before Hopper's newest cuBLAS take no other)? Elsewhere the product is
    computed as the kernel would, from the dequantised operands."""
    return (a.shape[0] % 16 == 0 and a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0
            and (scale_a.numel() == 1 or out_dtype in (torch.bfloat16, torch.float16)))


class AmaxHistory:
    """Delayed scaling's state for one FP8 linear layer (a recipe with ``amax_history``): the amax of its input and
    of its output gradient over its last ``length`` training calls, a row each, newest first.

    - **What a call is scaled by.** An input or output gradient is scaled by the largest amax of the calls before
      it, or by its own where that is larger: a value past the history's range is never clipped to it, so an
      overflow shows as it does in float32 (an infinite loss), never as a finite, wrong one. The first call scales
      by its own amax. The weight is scaled by its own amax at every call (current scaling, as torchao and
      Transformer Engine practise for weights): a weight written in any way (an optimizer step,
      ``load_state_dict``, ``nn.init``, ``.data``) is scaled by its new values at the next call.
    - **What is recorded.** A call's amaxes enter the history when its backward runs, and only when they and the
      gradients it computes are finite (a step whose gradients are not finite, the step ``GradScaler`` skips,
      teaches it nothing; neither does a call whose loss never reaches ``backward()``). Calls without gradients (evaluation) read it and record nothing.
    - **Checkpointing.** Activation checkpointing's recompute, inside the backward, scales as the forward it
      repeats did, whatever ran between them (two forwards before one backward): each training forward leaves
      its input's amax and the scale it used among ``pending``, which the recompute finds by that amax (the
      recompute reads the same values) and the backward clears.

    The converted graph module holds one per FP8 linear (copied and pickled with it); its tensors follow the
    operands to their device at an eager call.

    >>> h = AmaxHistory(2)
    >>> [float(h.scale_amax(0, torch.tensor([v]), record=False, recompute=False)[0]) for v in (3.0, 1.0)]
    [3.0, 1.0]
    >>> h.commit(torch.tensor(3.0), torch.tensor(5.0))   # a backward: input amax 3, gradient amax 5
    >>> [float(h.scale_amax(0, torch.tensor([v]), record=False, recompute=False)[0]) for v in (1.0, 4.0)]
    [3.0, 4.0]
    >>> h.commit(torch.tensor(float("inf")), torch.tensor(1.0))   # not finite: not recorded
    >>> h.values.tolist()
    [[3.0, 0.0], [5.0, 0.0]]
    """

    INPUT, GRAD = 0, 1
    PENDING = 32
    """How many training forwards' scales are kept for a recompute (those whose backward never ran drop out)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.values = torch.zeros(2, length)
        self.pending = torch.full((2, self.PENDING), -1.0)  # row 0: a forward's input amax, row 1: what it used

    def _follow(self, like: torch.Tensor) -> None:
        if self.values.device != like.device and not is_compiling():
            self.values, self.pending = self.values.to(like.device), self.pending.to(like.device)

    def scale_amax(self, row: int, x: torch.Tensor, record: bool,
                   recompute: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(used, current)``: the amax to scale ``x`` by (row ``row``: :attr:`INPUT` or :attr:`GRAD`) and ``x``'s
        own. ``record``: a training forward (its scale kept for a recompute); ``recompute``: a checkpointed
        forward run again inside the backward (the scale its forward used, where it is kept)."""
        with torch.no_grad():
            current = x.detach().abs().amax().float()
            self._follow(current)
            used = torch.maximum(self.values[row].max(), current)
            if row == self.INPUT and recompute:
                hit = self.pending[0] == current
                used = torch.where(hit.any(), self.pending[1][hit.int().argmax()], used)
            elif row == self.INPUT and record:
                self.pending.copy_(torch.roll(self.pending, 1, dims=1))
                self.pending[0, 0], self.pending[1, 0] = current, used
        return used, current

    def commit(self, input_amax: torch.Tensor, grad_amax: torch.Tensor, *grads: torch.Tensor | None) -> None:
        """A training call's backward: record its input's and output gradient's amax where both are finite, and so
        are the gradients ``grads`` it computed, and drop its forward's kept scale."""
        with torch.no_grad():
            self._follow(input_amax)
            ok = torch.isfinite(input_amax) & torch.isfinite(grad_amax)
            for g in grads:
                if g is not None:
                    ok = ok & torch.isfinite(g).all()
            for row, value in ((self.INPUT, input_amax), (self.GRAD, grad_amax)):
                shifted = torch.cat([value.reshape(1).to(self.values.dtype), self.values[row, :-1]])
                self.values[row].copy_(torch.where(ok, shifted, self.values[row]))
            hit = self.pending[0] == input_amax
            first = hit & (hit.cumsum(0) == 1)
            self.pending[0].masked_fill_(first, -1.0)

    @staticmethod
    def call() -> tuple[bool, bool]:
        """``(record, recompute)`` for a forward called now: it is a training forward when gradients are on, and a
        recompute inside the backward (activation checkpointing)."""
        recompute = torch._C._current_graph_task_id() != -1
        return torch.is_grad_enabled() and not recompute, recompute

    def __repr__(self) -> str:
        return f"AmaxHistory({self.length})"


class _Linear(torch.autograd.Function):
    """``x @ w.T (+ b)`` with its three GEMMs in FP8 (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, recipe: Recipe, history: AmaxHistory | None,
                call: tuple[bool, bool]) -> torch.Tensor:
        ax = aw = seen = None
        if history is not None:  # delayed scaling: the backward quantises x and w as this forward does
            ax, seen = history.scale_amax(AmaxHistory.INPUT, x, *call)
            aw = w.detach().abs().amax().float()  # the weight: its own amax at every call
        qx, sx = quantize(x, *recipe.scaling("input"), ax)
        qw, sw = quantize(w, *recipe.scaling("weight"), aw)
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.history, ctx.amax, ctx.seen = recipe, history, (ax, aw), seen
        return scaled_mm(qx, sx, qw.t(), sw.t() if recipe.rowwise else sw, x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        x, w = ctx.saved_tensors
        recipe: Recipe = ctx.recipe
        ax, aw = ctx.amax
        ag = seen_g = None
        if ctx.history is not None:
            ag, seen_g = ctx.history.scale_amax(AmaxHistory.GRAD, g, record=False, recompute=False)
        gx = gw = None
        if ctx.needs_input_grad[0]:  # g [M, N] @ w [N, K]: scaled along N
            qg, sg = quantize(g, *recipe.scaling("grad"), ag)
            qw, sw = quantize(w, *recipe.scaling("weight_t"), aw)
            gx = scaled_mm(qg, sg, qw, sw, x.dtype)
        if ctx.needs_input_grad[1]:  # g.T [N, M] @ x [M, K]: scaled along M
            if recipe.weight_grad_high_precision:
                gw = (g.t().to(x.dtype) @ x).to(w.dtype)
            else:
                qg, sg = quantize(g.t(), *recipe.scaling("grad_t"), ag)
                qx, sx = quantize(x, *recipe.scaling("input_t"), ax)
                gw = scaled_mm(qg, sg, qx, sx, torch.float32).to(w.dtype)
        if ctx.history is not None:
            ctx.history.commit(ctx.seen, seen_g, gx, gw)
        return gx, gw, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe,
           history: AmaxHistory | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` with its three GEMMs in FP8 under ``recipe`` (scaled by
    ``history`` under delayed scaling); the output has ``x``'s dtype, the bias is added in it."""
    lead = x.shape[:-1]
    call = AmaxHistory.call() if history is not None else (False, False)
    out = _Linear.apply(x.reshape(-1, x.shape[-1]), weight, recipe, history, call).reshape(*lead, weight.shape[0])
    return out if bias is None else out + bias.to(out.dtype)


@lru_cache(maxsize=None)
def _recipe(spec: Any) -> Recipe:
    return from_spec(spec)


def linear_fp8(x: Any, weight: Any, bias: Any, spec: Any, history: AmaxHistory | None = None) -> Any:
    """What a converted graph calls for a linear node the ``fp8`` pass put in FP8 (:mod:`ampfx.passes.fp8`):
    :func:`linear` under the recipe ``spec`` names (a preset's name, or :attr:`Recipe.spec`), with the layer's
    :class:`AmaxHistory` under delayed scaling. Re-tracing a converted module records the call again.

    >>> linear_fp8(torch.ones(2, 16), torch.ones(16, 16), None, "tensorwise")[0, :3].tolist()
    [16.0, 16.0, 16.0]
    """
    if isinstance(x, torch.fx.Proxy):
        return x.tracer.create_proxy("call_function", linear_fp8, (x, weight, bias, spec, history), {})
    return linear(x, weight, bias, _recipe(spec), history)
