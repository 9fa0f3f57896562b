"""Analysis of the converted graph: how many ATen GEMMs each node runs, and how many in the low dtype.

After the passes, the converted graph runs once on fake tensors made from the example inputs (no real
compute, no memory), in the dtypes the passes chose, while a dispatch mode counts the ATen ops of
:data:`ampfx.ops.ATEN_GEMMS` (matrix products, convolutions, fused attention) each node calls, by the
dtype of their first input. Each node's ``Decision`` gets ``gemms`` and ``gemms_low``: a leaf module or
an opaque function counts every GEMM it runs, so the report's total (``Report.gemms``) is what one
forward runs, not how many nodes are on the allow list. Where a node cannot run on fake tensors
(data-dependent Python in an opaque function, a leaf of a library whose kernels crash on them: DGL's), the
graph runs for real on the example inputs, without
gradients, buffers and random state put back. Kernel choices follow the real ones: fake tensors keep
their device and dtype, so a leaf counts the products the kernels it picks on that device run
(``nn.MultiheadAttention`` four on CPU, three without attention weights).

Before: ``linear = torch._C._nn.linear(x_bf16, w_bf16, b_bf16)`` with ``Decision(gemms=None)``.
After:  the same graph, ``Decision(gemms=1, gemms_low=1)`` (one ``aten.addmm`` reading bfloat16).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .. import libraries, ops
from ..inputs import ExampleInputs
from ..meta import RECORD, record
from ..ops.shape_memo import ShapeMemo
from ..report.records import Decision, Rule
from ..state import kept_attributes, kept_buffers, kept_rng, kept_transforms


class _Count(TorchDispatchMode):
    """Counts the ATen GEMMs each node calls while active: ``(all, low)`` per node."""

    def __init__(self, low: torch.dtype) -> None:
        super().__init__()
        self.low = low
        self.node: fx.Node | None = None
        self.all: Counter = Counter()
        self.low_ones: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        if func.overloadpacket in ops.ATEN_GEMMS and args and isinstance(args[0], torch.Tensor):
            self.all[self.node] += 1
            self.low_ones[self.node] += args[0].dtype == self.low
        return func(*args, **(kwargs or {}))


class _Counting(fx.Interpreter):
    """Runs the graph with ``count`` told which node runs. With a ``memo`` (fake tensors only), a call
    repeated on the same sizes (the blocks of a deep model) reuses the result and the counts of the first
    (:class:`~ampfx.ops.shape_memo.ShapeMemo`): a batch norm on fake tensors runs a Python decomposition."""

    def __init__(self, gm: fx.GraphModule, count: _Count, memo: ShapeMemo | None = None) -> None:
        super().__init__(gm)
        self.count, self.memo = count, memo
        self.counts: dict[Any, tuple[int, int]] = {}

    def run_node(self, n: fx.Node) -> Any:
        self.count.node = n
        return super().run_node(n)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        d = record(self.count.node)
        if isinstance(d, Decision) and d.rule is Rule.KEPT:
            return self._kept(target, args, kwargs, d)
        if self.memo is None:
            return super().call_module(target, args, kwargs)
        mod = self.fetch_attr(target)
        key, state = self.memo.key_of_module(mod, args, kwargs), self.memo.state_of(mod)
        return self._reused(key, lambda: super(_Counting, self).call_module(target, args, kwargs), args, kwargs,
                            mod, state)

    def _kept(self, target: Any, args: Any, kwargs: Any, d: Decision) -> Any:
        """A kept module (rule ``keep_modules``) is converted on its own graph, which counts its GEMMs; here
        it is still the float32 module: it runs on its float inputs widened to float32, and hands on its
        result in the dtype its converted graph returns to this one (``Decision.out``)."""
        def wide(t: Any) -> Any:
            return t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16) else t

        out = super().call_module(target, tree_map(wide, args), tree_map(wide, kwargs))
        to = d.out if isinstance(d.out, torch.dtype) else None
        return tree_map(lambda t: t.to(to) if to is not None and isinstance(t, torch.Tensor)
                        and t.dtype == torch.float32 else t, out)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if self.memo is None or target in ops.TRANSFORM_CALLS:
            return super().call_function(target, args, kwargs)  # a transform's level: never a memo's result
        return self._reused(self.memo.key_of_call(target, args, kwargs),
                            lambda: super(_Counting, self).call_function(target, args, kwargs), args, kwargs)

    def _reused(self, key: Any, run: Any, args: Any, kwargs: Any, module: Any = None, state: Any = None) -> Any:
        node, found = self.count.node, self.memo.find(key)
        if found is not None and key in self.counts:
            self.count.all[node], self.count.low_ones[node] = self.counts[key]
            return found
        result = run()
        self.memo.keep(key, result, args, kwargs, module, state)
        if key is not None:
            self.counts[key] = (self.count.all[node], self.count.low_ones[node])
        return result


def count_gemms(gm: fx.GraphModule, example_inputs: Any, dtype: torch.dtype) -> str:
    """Write each node's GEMM counts into its ``Decision`` (see the module docstring); returns how they
    were counted (``"fake"``, ``"real"``, or why they were not)."""
    args = ExampleInputs.of(example_inputs).positional(gm)
    with kept_buffers(gm), kept_attributes(gm, bookkeeping=False), kept_rng(*gm.parameters()), torch.no_grad():
        try:
            if not all(libraries.runs_on_fake_tensors(m) for m in gm.modules()):
                raise NotImplementedError("a leaf cannot run on fake tensors")  # DGL's kernels crash on them
            from torch._subclasses.fake_tensor import FakeTensorMode

            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with kept_transforms(), mode, _Count(dtype) as count:
                fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
                _Counting(gm, count, ShapeMemo()).run(*fakes)
            how = "fake"
        except Exception:  # noqa: BLE001 - data-dependent Python cannot run on fake tensors: run for real
            try:
                with kept_transforms(), _Count(dtype) as count:
                    _Counting(gm, count).run(*args)
                how = "real"
            except Exception as e:  # noqa: BLE001 - a count is not worth failing a conversion for
                return f"GEMMs not counted: the converted graph did not run on the example inputs ({e})"
    for node in gm.graph.nodes:
        d = record(node)
        if isinstance(d, Decision):
            # an FP8 linear runs its GEMM in FP8, below the low dtype, though its emulation off a GPU reads float32
            low = count.all[node] if d.fp8 is not None and d.fp8.output else count.low_ones[node]
            node.meta[RECORD] = dataclasses.replace(d, gemms=count.all[node], gemms_low=low)
    return how
