"""``passes/classify.py``: the category, dtype and rule every node gets from the
tables, the policy and module names (records in ``node.meta['ampfx']``)."""
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx import Category, Policy, meta
from ampfx.passes import classify
from ampfx.policy import from_env

from .helpers import context, graph, rec, run, run_passes

CLASSIFY = dict(upto=classify.classify)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)  # a call_module leaf under symbolic_trace
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return torch.tanh(F.linear(self.fc(x), self.w))


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = Block(), Block()

    def forward(self, x):
        return self.head(self.body(x))


@pytest.mark.parametrize("fn,op,category,dtype", [
    (lambda x: F.linear(x, x), "linear", Category.ALLOW, None),
    (torch.tanh, "tanh", Category.INFER, None),
    (torch.relu, "relu", Category.CLEAR, None),
    (torch.exp, "exp", Category.DENY, torch.float32),
], ids=["allow", "infer", "clear", "deny"])
def test_listed_ops_get_their_tables_category(fn, op, category, dtype):
    """An op on one of the four lists gets that category with rule "table";
    only DENY fixes the dtype (float32) here, the others are left to paint."""
    gm, _ = run(lambda x: fn(x), **CLASSIFY)
    d = rec(gm, op)
    assert (d.op, d.category, d.dtype, d.rule) == (op, category, dtype, "table")


@pytest.mark.parametrize("dtype,category", [(torch.bfloat16, Category.INFER), (torch.float16, Category.DENY)])
def test_the_table_entry_depends_on_the_low_dtype(dtype, category):
    """``rsqrt`` is INFER under bfloat16 (float32's range) and DENY under float16 (1/sqrt(x) overflows)."""
    gm, _ = run(lambda x: torch.rsqrt(x), dtype=dtype, **CLASSIFY)
    assert (rec(gm, "rsqrt").category, rec(gm, "rsqrt").rule) == (category, "table")


def test_inputs_parameters_and_outputs_are_structure():
    """Placeholders, get_attr and output nodes are PASS with rule "structure"; an input
    is assumed float32 without shapes, a parameter has its own dtype, an integer buffer none."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            return F.linear(x, self.w) + self.steps

    gm, _ = run(Net(), **CLASSIFY)
    for name, out in [("x", torch.float32), ("w", torch.float32), ("steps", None), ("output", None)]:
        d = rec(gm, name)
        assert (d.category, d.rule, d.dtype, d.out) == (Category.PASS, "structure", None, out), name
    assert all(meta.record(n) is not None for n in gm.graph.nodes)


def test_pass_ops_from_the_table_are_left_as_written():
    """Comparisons and explicit conversions are PASS by the table (rule "table", no dtype)."""
    gm, _ = run(lambda x: ((x > 0), x.float()), **CLASSIFY)
    for name, op in [("gt", "compare"), ("float_1", "to")]:
        d = rec(gm, name)
        assert (d.op, d.category, d.dtype, d.rule) == (op, Category.PASS, None, "table")


def test_an_op_with_no_float_data_in_or_out_is_non_float():
    """With shapes, an otherwise listed op on integer tensors is PASS "non-float";
    without shapes the same input is assumed float32 and the op keeps its list."""
    fn = lambda i: torch.relu(i)  # noqa: E731
    gm, _ = run(fn, (torch.arange(6),), **CLASSIFY)
    assert (rec(gm, "relu").category, rec(gm, "relu").rule) == (Category.PASS, "non-float")
    gm, _ = run(fn, **CLASSIFY)
    assert (rec(gm, "relu").category, rec(gm, "relu").rule) == (Category.CLEAR, "table")


def test_an_unlisted_op_is_float32_and_says_how_to_list_it():
    """An op on no list gets category FP32, dtype float32, rule "unlisted", and the
    reason names it and the variables that would list it."""
    gm, _ = run(lambda x: torch.atan(x), **CLASSIFY)
    d = rec(gm, "atan")
    assert (d.category, d.dtype, d.rule) == (Category.FP32, torch.float32, "unlisted")
    assert "torch.atan" in d.reason and "AMPFX_ALLOWLIST_ADD" in d.reason


def test_fp32_modules_keep_every_node_inside_the_named_module_float32():
    """``fp32_modules=("head",)`` makes every node traced inside ``head`` (leaf module
    calls and functions alike) FP32 with rule "fp32_modules"; ``body`` keeps its table rules."""
    gm, _ = run(TwoBlocks(), fp32_modules=("head",), **CLASSIFY)
    for name in ("head_fc", "linear_1", "tanh_1"):
        d = rec(gm, name)
        assert (d.category, d.dtype, d.rule, d.module) == (Category.FP32, torch.float32, "fp32_modules",
                                                           "head" if name != "head_fc" else "head.fc"), name
    assert [rec(gm, n).rule for n in ("body_fc", "linear", "tanh")] == ["table"] * 3


def test_fp32_modules_win_over_list_edits():
    """Precedence: a module kept float32 by name beats an op moved by a list edit."""
    gm, _ = run(TwoBlocks(), fp32_modules=("head",), denylist_add=("tanh",), inferlist_remove=("tanh",),
                **CLASSIFY)
    assert (rec(gm, "tanh").category, rec(gm, "tanh").rule) == (Category.DENY, "argument")
    assert (rec(gm, "tanh_1").category, rec(gm, "tanh_1").rule) == (Category.FP32, "fp32_modules")


def test_module_filter_fn_rejecting_a_module_keeps_it_float32():
    """``module_filter_fn(module, fqn)`` returning False for ``body`` makes the nodes inside
    it FP32 with rule "module_filter_fn"; modules it accepts are untouched."""
    gm, _ = run(TwoBlocks(), module_filter_fn=lambda m, fqn: fqn != "body", **CLASSIFY)
    assert {rec(gm, n).rule for n in ("body_fc", "linear", "tanh")} == {"module_filter_fn"}
    assert rec(gm, "linear").category is Category.FP32
    assert [rec(gm, n).rule for n in ("head_fc", "linear_1", "tanh_1")] == ["table"] * 3


def test_a_policy_argument_moves_an_op_between_lists():
    """``denylist_add`` + ``clearlist_remove`` makes relu DENY (float32) with rule
    "argument"; ``allowlist_add`` lists an unlisted op as ALLOW."""
    gm, _ = run(lambda x: torch.atan(torch.relu(x)), denylist_add=("relu",), clearlist_remove=("relu",),
                allowlist_add=("torch.atan",), **CLASSIFY)
    assert (rec(gm, "relu").category, rec(gm, "relu").dtype, rec(gm, "relu").rule) == (
        Category.DENY, torch.float32, "argument")
    assert (rec(gm, "atan").category, rec(gm, "atan").rule) == (Category.ALLOW, "argument")


def test_an_environment_list_edit_names_its_variable():
    """A list edit read from ``AMPFX_*`` variables (``policy.from_env``) is recorded as
    rule "env:<VAR>", the variable that added the op."""
    policy = from_env(Policy(probe=False), {"AMPFX_DENYLIST_ADD": "tanh", "AMPFX_INFERLIST_REMOVE": "tanh"})
    gm, _ = run(lambda x: torch.tanh(x), policy=policy, **CLASSIFY)
    assert (rec(gm, "tanh").category, rec(gm, "tanh").rule) == (Category.DENY, "env:AMPFX_DENYLIST_ADD")


@pytest.mark.parametrize("dtype,expect", [(torch.float16, ("range:constant", Category.FP32)),
                                          (torch.bfloat16, ("table", Category.INFER))])
def test_a_constant_the_low_dtype_cannot_hold_keeps_the_op_float32(dtype, expect):
    """``x * 1e5``: 1e5 is beyond float16's 65504, so under float16 the mul is FP32
    "range:constant"; bfloat16 holds it and the mul stays INFER."""
    gm, _ = run(lambda x: x * 1e5, dtype=dtype, **CLASSIFY)
    assert (rec(gm, "mul").rule, rec(gm, "mul").category) == expect


@pytest.mark.parametrize("module", [nn.Threshold(0.1, -1e5), nn.Hardtanh(-1e5, 1e5)], ids=["Threshold", "Hardtanh"])
def test_a_leaf_modules_constant_the_low_dtype_cannot_hold_keeps_it_float32(module):
    """The module form keeps its constant as an attribute, not an argument: float16 would raise at the
    first call (``value cannot be converted to type c10::Half without overflow``; found by review)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), module, nn.Softmax(-1))
    x = torch.randn(2, 8)
    amp = ampfx.convert(m, torch.float16, example_inputs=(x,))
    assert amp.ampfx_report.by_node("_1").rule == "range:constant"
    assert (amp(x) - m(x)).abs().max() < 1e-3


def test_in_place_ops_are_flagged():
    """``x.add_(y)`` and ``F.relu(x, inplace=True)`` are in-place; ``x.add(y)`` is not.
    In-place spellings name the same op as their out-of-place form."""
    def fn(x, y):
        a = x.add(y)
        x.add_(y)
        return F.relu(a, inplace=True)

    gm, _ = run(fn, **CLASSIFY)
    assert [(rec(gm, n).op, rec(gm, n).inplace) for n in ("add", "add_", "relu")] == [
        ("add", False), ("add", True), ("relu", True)]


def test_a_write_by_a_dunder_method_called_by_name_is_in_place():
    """``a.__setitem__(0, 1.0)`` on a row of a low GEMM's output wrote a float32 copy the later product
    did not read: the result was off by 0.5 (found by review). It is in place, so it writes the row."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 12)

        def forward(self, x):
            t = self.lin(x).view(x.shape[0], 3, 4).permute(1, 0, 2)
            a, b, c = t[0], t[1], t[2]
            a.__setitem__(0, 1.0)
            return a * b + c

    torch.manual_seed(0)
    m, x = M(), torch.randn(2, 4)
    amp = ampfx.convert(m, torch.bfloat16, example_inputs=(x,))
    assert [r.inplace for r in amp.ampfx_report.compute if r.op == "Tensor.__setitem__"] == [True]
    assert (amp(x).float() - m(x)).abs().max() < 0.05


def test_a_region_leaf_is_float32_whatever_its_type():
    """A call_module node named in ``ctx.eager_leaves`` (a module that could not be traced,
    run eagerly) is FP32 with rule "eager", even when its type is on the allow list."""
    gm = graph(Block())
    ctx = dataclasses.replace(context(gm), leaves={"fc": "it failed to trace"}).at(eager_leaves=frozenset({"fc"}))
    run_passes(gm, ctx, upto=classify.classify)
    d = rec(gm, "fc")
    assert (d.category, d.dtype, d.rule) == (Category.FP32, torch.float32, "eager")
    assert "it failed to trace" in d.reason
    assert rec(gm, "linear").rule == "table"


class _Likes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h + torch.zeros_like(h) + h.new_zeros(h.shape) + torch.ones_like(h, dtype=torch.float32)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_like_factories_take_their_arguments_converted_dtype(tracer):
    """zeros_like(h) / h.new_zeros(...) of a bfloat16 h are bfloat16 (their shape pass ran in float32, and
    said float32: the record and the cast plan were wrong); with dtype= they are what it says."""
    import ampfx
    amp = ampfx.convert(_Likes(), "bf16", example_inputs=(torch.randn(2, 4),), tracer=tracer)
    outs = {r.node: r.out for r in amp.ampfx_report.records if r.op == "factory"}
    assert sorted(map(str, outs.values())) == ["torch.bfloat16", "torch.bfloat16", "torch.float32"], outs
