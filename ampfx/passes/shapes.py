"""Pass: record the dtype and shape of every node's output from example inputs.

With ``example_inputs`` the graph is run on ``FakeTensor``s (no real
arithmetic, no activation memory) and each node gets
``node.meta['ampfx_out'] = (TensorInfo, ...)``, one entry per tensor in its
output. If fake propagation fails (a leaf that cannot run on fake tensors),
the graph runs for real on the example inputs in eval mode under
``no_grad``, and the report says so. Buffers are restored afterwards either
way (a batch-norm leaf counts its batches even on fake tensors).
Without example inputs no node gets ``ampfx_out`` and the passes use the
conservative defaults (graph inputs are assumed float32; casts check the
dtype at run time).

Before: ``linear = torch._C._nn.linear(x, w, b)`` with ``meta = {}``.
After:  same graph, ``linear.meta['ampfx_out'] == (TensorInfo((8, 4), torch.float32),)``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one output tensor."""

    shape: tuple
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{str(self.dtype).replace('torch.', '')}[{', '.join(str(s) for s in self.shape)}]"


def bind_inputs(gm: fx.GraphModule, example_inputs: Any) -> list[Any]:
    """Example inputs (a tuple of positional values, a dict of keyword values,
    or one tensor) as the positional list the graph's placeholders take."""
    if isinstance(example_inputs, dict):
        args, kwargs = (), example_inputs
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (example_inputs,), {}
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return list(bound.args) + list(bound.kwargs.values())


def _record(node: fx.Node, value: Any) -> None:
    infos = tuple(TensorInfo(tuple(t.shape), t.dtype) for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    node.meta["ampfx_out"] = infos


def propagate(gm: fx.GraphModule, example_inputs: Any) -> tuple[str, str]:
    """Annotate every node; returns ``(method, note)`` with method
    ``"fake"`` or ``"real"``."""
    args = bind_inputs(gm, example_inputs)
    saved = [(b, b.detach().clone()) for b in gm.buffers()]
    try:
        return _propagate(gm, args)
    finally:  # leaves may update buffers in place (batch-norm counters): undo it
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _propagate(gm: fx.GraphModule, args: list[Any]) -> tuple[str, str]:
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake_args)
        for node in gm.graph.nodes:
            if "val" in node.meta:
                _record(node, node.meta["val"])
        return "fake", "shapes from FakeTensor propagation (no real compute)"
    except Exception as e:  # noqa: BLE001 - any failure falls back to real execution
        note = f"FakeTensor propagation failed ({type(e).__name__}: {str(e)[:200]}); ran the example inputs for real"
    modes = {m: m.training for m in gm.modules()}
    gm.eval()
    try:
        with torch.no_grad():
            interp = fx.Interpreter(gm)
            env_run = interp.run_node

            def run_node(n: fx.Node) -> Any:
                result = env_run(n)
                _record(n, result)
                return result

            interp.run_node = run_node
            interp.run(*args)
    finally:
        for m, flag in modes.items():
            m.training = flag
    return "real", note
