"""``passes/shapes.py`` on tiny traced graphs: what ``propagate`` records in ``node.meta``."""
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampfx import meta
from ampfx.passes import shapes
from ampfx.passes.shapes import TensorInfo

from .helpers import graph, node


@torch.fx.wrap
def _first_k(x):
    """Data-dependent output size: no meta or fake tensor can say how long it is."""
    return x[: int(x.abs().argmax()) + 1]


class Affine(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.relu(F.linear(x, self.w, self.b))


def _shape(gm, name):
    return meta.out_infos(node(gm, name))


def test_every_node_gets_the_dtype_and_sizes_of_its_output():
    """Without dynamic_dims the graph runs on meta tensors, and every node
    (inputs, parameters, ops and the output) gets one TensorInfo per tensor."""
    gm = graph(Affine())
    method, _, symbols = shapes.propagate(gm, (torch.randn(8, 6),))
    assert method == "meta" and symbols.ranges == {}
    assert _shape(gm, "x") == (TensorInfo((8, 6), torch.float32),)
    assert _shape(gm, "w") == (TensorInfo((4, 6), torch.float32),)
    assert _shape(gm, "linear") == (TensorInfo((8, 4), torch.float32),)
    assert _shape(gm, "relu") == (TensorInfo((8, 4), torch.float32),)
    assert all(meta.out_infos(n) is not None for n in gm.graph.nodes)


def test_dtypes_are_those_the_nodes_produce():
    """The recorded dtype is the node's own: a float16 input, an explicit
    cast to bfloat16 and an integer argmax each keep theirs."""
    gm = graph(lambda x: (x.to(torch.bfloat16) * 2, x.argmax(-1)))
    shapes.propagate(gm, (torch.randn(3, 5, dtype=torch.float16),))
    assert _shape(gm, "x")[0].dtype == torch.float16
    assert _shape(gm, "to")[0].dtype == torch.bfloat16
    assert _shape(gm, "mul")[0].dtype == torch.bfloat16
    assert _shape(gm, "argmax") == (TensorInfo((3,), torch.int64),)


def test_a_node_producing_several_tensors_gets_one_info_each():
    """``torch.max(x, dim)`` returns values and indices: two TensorInfos, in order."""
    gm = graph(lambda x: torch.max(x, 1))
    shapes.propagate(gm, (torch.randn(4, 3),))
    assert _shape(gm, "max_1") == (TensorInfo((4,), torch.float32), TensorInfo((4,), torch.int64))


def test_keyword_example_inputs_bind_to_the_placeholders():
    """Example inputs given as a dict bind by name, like keyword arguments."""
    gm = graph(lambda a, b: a @ b)
    shapes.propagate(gm, {"b": torch.randn(3, 7), "a": torch.randn(2, 3)})
    assert _shape(gm, "a")[0].shape == (2, 3) and _shape(gm, "b")[0].shape == (3, 7)
    assert _shape(gm, "matmul")[0].shape == (2, 7)


def test_dynamic_dims_give_named_symbolic_sizes():
    """``dynamic_dims={0: "batch"}`` makes dim 0 symbolic (fake tensors): sizes
    are sympy expressions over a symbol called ``batch``, and ``symbols``
    knows its range."""
    gm = graph(lambda x: torch.cat([x, x]).reshape(-1))
    method, _, symbols = shapes.propagate(gm, (torch.randn(4, 3),), {0: "batch"})
    batch = sympy.Symbol("batch", integer=True, positive=True)
    assert method == "fake"
    assert _shape(gm, "x")[0].shape == (batch, 3)
    assert _shape(gm, "cat")[0].shape == (2 * batch, 3)
    assert _shape(gm, "reshape")[0].shape == (6 * batch,)
    assert list(symbols.ranges) == [batch]
    assert symbols.bounds(6 * batch)[0] == 12  # the symbol is at least 2 (0 and 1 are specialised)
    assert symbols.bounds(7) == (7, 7)


def test_numel_of_a_symbolic_info_is_an_expression():
    """``TensorInfo.numel`` is an int for static sizes, a sympy product for symbolic ones;
    ``str`` shows ``dtype[sizes]``."""
    batch = sympy.Symbol("batch", integer=True, positive=True)
    assert TensorInfo((2, 3), torch.float16).numel() == 6
    assert TensorInfo((batch, 3), torch.float32).numel() == 3 * batch
    assert str(TensorInfo((batch, 3), torch.float16)) == "float16[batch, 3]"


def test_data_dependent_leaves_fall_back_to_running_the_inputs_for_real():
    """When neither meta nor fake tensors can run the graph (an output size that
    depends on values), the example inputs run for real and the real sizes are recorded."""
    gm = graph(lambda x: _first_k(x) * 2)
    method, note, _ = shapes.propagate(gm, (torch.tensor([1.0, 5.0, 2.0]),))
    assert method == "real" and "ran the example inputs for real" in note
    assert _shape(gm, "mul") == (TensorInfo((2,), torch.float32),)


def test_buffers_are_restored_after_fake_propagation():
    """A batch-norm leaf in training mode updates its statistics when it runs;
    propagation (here on fake tensors) puts every buffer back."""
    bn = nn.BatchNorm1d(3)
    gm = graph(nn.Sequential(bn))
    gm.train()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    shapes.propagate(gm, (torch.randn(5, 3) * 10 + 3,), {0: "batch"})
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert _shape(gm, "_0")[0].shape[1] == 3

