"""``passes/shapes.py`` on tiny traced graphs: what ``propagate`` records in ``node.meta``."""
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampfx import meta
from ampfx.passes import shapes
from torch.fx.passes.shape_prop import TensorMetadata

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


def _sized(shape, dtype):
    """What a test checks of one recorded ``TensorMetadata``: its sizes and dtype."""
    return tuple(shape), dtype


def _facts(infos):
    return tuple((tuple(i.shape), i.dtype) for i in infos)


def test_every_node_gets_the_dtype_and_sizes_of_its_output():
    """Without dynamic_dims the graph runs on meta tensors, and every node
    (inputs, parameters, ops and the output) gets one TensorMetadata per tensor."""
    gm = graph(Affine())
    method, _, symbols = shapes.propagate(gm, (torch.randn(8, 6),))
    assert method == "meta" and symbols.ranges == {}
    assert _facts(_shape(gm, "x")) == (_sized((8, 6), torch.float32),)
    assert _facts(_shape(gm, "w")) == (_sized((4, 6), torch.float32),)
    assert _facts(_shape(gm, "linear")) == (_sized((8, 4), torch.float32),)
    assert _facts(_shape(gm, "relu")) == (_sized((8, 4), torch.float32),)
    assert all(meta.out_infos(n) is not None for n in gm.graph.nodes)


def test_dtypes_are_those_the_nodes_produce():
    """The recorded dtype is the node's own: a float16 input, an explicit
    cast to bfloat16 and an integer argmax each keep theirs."""
    gm = graph(lambda x: (x.to(torch.bfloat16) * 2, x.argmax(-1)))
    shapes.propagate(gm, (torch.randn(3, 5, dtype=torch.float16),))
    assert _shape(gm, "x")[0].dtype == torch.float16
    assert _shape(gm, "to")[0].dtype == torch.bfloat16
    assert _shape(gm, "mul")[0].dtype == torch.bfloat16
    assert _facts(_shape(gm, "argmax")) == (_sized((3,), torch.int64),)


def test_a_node_producing_several_tensors_gets_one_info_each():
    """``torch.max(x, dim)`` returns values and indices: two TensorMetadata, in order."""
    gm = graph(lambda x: torch.max(x, 1))
    shapes.propagate(gm, (torch.randn(4, 3),))
    assert _facts(_shape(gm, "max_1")) == (_sized((4,), torch.float32), _sized((4,), torch.int64))


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
    """``meta.numel`` is an int for static sizes, a sympy product for symbolic ones;
    ``meta.describe`` shows ``dtype[sizes]``."""
    batch = sympy.Symbol("batch", integer=True, positive=True)

    def info(shape, dtype):
        return TensorMetadata(shape, dtype, False, (), None, False, {})

    assert meta.numel(info(torch.Size((2, 3)), torch.float16)) == 6
    assert meta.numel(info((batch, 3), torch.float32)) == 3 * batch
    assert meta.describe(info((batch, 3), torch.float16)) == "float16[batch, 3]"


def test_data_dependent_leaves_fall_back_to_running_the_inputs_for_real():
    """When neither meta nor fake tensors can run the graph (an output size that
    depends on values), the example inputs run for real and the real sizes are recorded."""
    gm = graph(lambda x: _first_k(x) * 2)
    method, note, _ = shapes.propagate(gm, (torch.tensor([1.0, 5.0, 2.0]),))
    assert method == "real" and "ran the example inputs for real" in note
    assert _facts(_shape(gm, "mul")) == (_sized((2,), torch.float32),)


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



class _Leaves(torch.fx.Tracer):
    """Every module a leaf: their runs on meta tensors are what the memo reuses."""

    def is_leaf_module(self, m, qualname):
        return True


def _leaf_graph(root):
    return torch.fx.GraphModule(root, _Leaves().trace(root))


class _Grows(nn.Module):
    """Each call widens its output: its run changes its own attribute."""

    def __init__(self):
        super().__init__()
        self.n = 1

    def forward(self, x):
        self.n += 1
        return x.repeat(1, self.n)


class _Calls(nn.Module):
    """Output size from a function attribute, which no key can see."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class _Twice(nn.Module):
    def __init__(self, *mods):
        super().__init__()
        self.mods = nn.ModuleList(mods)

    def forward(self, x):
        return [m(x) for m in self.mods]


def test_repeated_blocks_reuse_their_sizes_and_record_the_same_as_a_run():
    """A stack of identical blocks runs each op once per distinct sizes; every
    node records what running it records (the memo is off in the second graph)."""
    model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 6), nn.GELU()) for _ in range(4)],
                          nn.Linear(6, 3))
    gm = _leaf_graph(model)
    runs = []
    original = nn.LayerNorm.forward
    nn.LayerNorm.forward = lambda self, x: runs.append(1) or original(self, x)
    try:
        shapes.propagate(gm, (torch.randn(2, 6),))
    finally:
        nn.LayerNorm.forward = original
    assert len(runs) == 1
    unmemo = _leaf_graph(model)
    keep = shapes.ShapeMemo.find
    shapes.ShapeMemo.find = lambda self, key: None
    try:
        shapes.propagate(unmemo, (torch.randn(2, 6),))
    finally:
        shapes.ShapeMemo.find = keep
    assert [meta.out_infos(n) for n in gm.graph.nodes] == [meta.out_infos(n) for n in unmemo.graph.nodes]
    assert _facts(meta.out_infos(list(gm.graph.nodes)[-2])) == (_sized((2, 3), torch.float32),)


def test_a_module_that_changes_its_attributes_runs_on_every_call():
    """The same instance called twice widens its output each time: the second
    call's sizes are its own, not the first call's."""
    grows = _Grows()
    gm = _leaf_graph(_Twice(grows, grows, grows))
    shapes.propagate(gm, (torch.randn(2, 3),))
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [meta.out_infos(n)[0].shape for n in calls] == [(2, 6), (2, 9), (2, 12)]


def test_modules_with_function_attributes_or_hooks_are_not_reused():
    """Two instances of one class whose behaviour sits in a function attribute,
    or in a forward hook, have the same sizes and attributes but differ."""
    hooked = nn.ReLU()
    hooked.register_forward_hook(lambda m, args, out: out.repeat(2, 1))
    gm = _leaf_graph(_Twice(_Calls(torch.relu), _Calls(lambda x: x.repeat(1, 2)), nn.ReLU(), hooked))
    shapes.propagate(gm, (torch.randn(2, 3),))
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [meta.out_infos(n)[0].shape for n in calls] == [(2, 3), (2, 6), (2, 3), (4, 3)]


def test_in_place_size_changes_are_not_lost():
    """``unsqueeze_`` changes its input's sizes: a second one on a value of the
    same sizes must run again, and ``contiguous`` (which returns its input) too."""
    def f(x, y):
        a = x.contiguous()
        a.unsqueeze_(0)
        b = y.contiguous()
        b.unsqueeze_(0)
        return x + 0, y + 0

    gm = graph(f)
    shapes.propagate(gm, (torch.randn(2, 3), torch.randn(2, 3)))
    assert _shape(gm, "add") == _shape(gm, "add_1")
    assert _facts(_shape(gm, "add")) == (_sized((1, 2, 3), torch.float32),)


class _Heads(nn.Module):
    """Its output's layout and dtype come from plain attributes whose names contain "hook"."""

    def __init__(self, heads, dtype):
        super().__init__()
        self.hook_heads, self.hook_dtype = heads, dtype

    def forward(self, x):
        return x.reshape(x.shape[0], self.hook_heads, -1).to(self.hook_dtype)


def test_attributes_named_like_hooks_are_part_of_a_modules_key():
    """Only nn.Module's own hook dictionaries are left out of the key: two instances differing in a
    user attribute called ``hook_dtype`` record their own dtypes and sizes."""
    gm = _leaf_graph(_Twice(_Heads(2, torch.float32), _Heads(4, torch.float16)))
    shapes.propagate(gm, (torch.randn(3, 8),))
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [_facts(meta.out_infos(n)) for n in calls] == [(_sized((3, 2, 4), torch.float32),),
                                                          (_sized((3, 4, 2), torch.float16),)]


class _GrowsWhenGiven(nn.Module):
    """Widens its later outputs only on a call given a complex number (an argument no key holds)."""

    def __init__(self):
        super().__init__()
        self.n = 1

    def forward(self, x, flag=None):
        if flag is not None:
            self.n += 1
        return x.repeat(1, self.n)


class _ThreeCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.other, self.grows = _GrowsWhenGiven(), _GrowsWhenGiven()

    def forward(self, x):
        return self.other(x), self.grows(x, 1j), self.grows(x)


def test_a_change_made_by_a_call_without_a_key_is_not_missed():
    """``other(x)`` stores the sizes for ``n == 1``; ``grows(x, 1j)`` (no key: a complex argument)
    raises ``grows``'s ``n`` to 2 on its meta copy; ``grows(x)`` then has the key ``other`` stored
    (the original's ``n`` is still 1) but must run: it is twice as wide."""
    gm = _leaf_graph(_ThreeCalls())
    shapes.propagate(gm, (torch.randn(2, 3),))
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [meta.out_infos(n)[0].shape for n in calls] == [(2, 3), (2, 6), (2, 6)]


def test_tensor_meta_is_torchs_own_and_mirrors_the_result():
    """Shapes land in torch's ``node.meta['tensor_meta']`` as ``TensorMetadata``, in the shape of the
    result (ShapeProp's form): a tuple result gets a tuple, a node without a tensor ``None``; symbolic
    sizes are sympy expressions over the given names, so the graph deep-copies and pickles."""
    import copy
    import pickle

    gm = graph(lambda x: (torch.max(x, 1), x.shape[0]))
    shapes.propagate(gm, (torch.randn(4, 3),), {0: "batch"})
    batch = sympy.Symbol("batch", integer=True, positive=True)
    max_1 = node(gm, "max_1")
    values, indices = max_1.meta["tensor_meta"]
    assert isinstance(values, TensorMetadata) and values.shape == (batch,) and indices.dtype == torch.int64
    assert node(gm, "x").meta["tensor_meta"].stride == (3, 1)
    size = [n for n in gm.graph.nodes if n.op == "call_function" and n.args and n.args[0] is node(gm, "getattr_1")]
    assert [n.meta["tensor_meta"] for n in size] == [None] and meta.out_infos(size[0]) == ()
    assert all("tensor_meta" in n.meta for n in gm.graph.nodes)
    for n in gm.graph.nodes:
        n.meta.pop("val", None)  # fake tensors: what convert removes after the passes
    again = pickle.loads(pickle.dumps(gm.graph))
    assert [meta.out_infos(n) for n in again.nodes] == [meta.out_infos(n) for n in gm.graph.nodes]
    assert [meta.out_infos(n) for n in copy.deepcopy(gm.graph).nodes] == [meta.out_infos(n) for n in gm.graph.nodes]
