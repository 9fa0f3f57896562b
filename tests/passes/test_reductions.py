"""``passes/reductions.py``: table decisions of reductions refined by how many
elements each output reduces (small ones follow their inputs, large ones float32)."""
import pytest
import sympy
import torch

from ampfx import Category
from ampfx.passes import reductions
from ampfx.passes.reductions import reduced_count

from .helpers import node, rec, run

REDUCTIONS = dict(upto=reductions.decide_reductions)


def sums(x):
    return x.sum(), x.sum(-1), torch.cumsum(x, 0), x.var()


def test_a_small_reduction_follows_its_inputs():
    """Under float16 the table puts sum on the deny list; over 128 elements
    (<= the threshold) it becomes INFER "shape:small-reduction", dtype left to paint."""
    gm, _ = run(sums, (torch.randn(8, 16),), dtype=torch.float16, **REDUCTIONS)
    d = rec(gm, "sum_1")
    assert (d.category, d.dtype, d.rule) == (Category.INFER, None, "shape:small-reduction")
    assert "128 elements" in d.reason


def test_a_large_reduction_accumulates_in_float32():
    """Over more elements than ``reduction_threshold``: DENY, float32, "shape:large-reduction".
    The count is per output element: ``sum(-1)`` reduces 16, ``cumsum(x, 0)`` 8."""
    gm, _ = run(sums, (torch.randn(8, 16),), dtype=torch.float16, reduction_threshold=12, **REDUCTIONS)
    assert [(rec(gm, n).category, rec(gm, n).rule) for n in ("sum_1", "sum_2", "cumsum", "var")] == [
        (Category.DENY, "shape:large-reduction"), (Category.DENY, "shape:large-reduction"),
        (Category.INFER, "shape:small-reduction"), (Category.DENY, "shape:large-reduction")]
    assert rec(gm, "sum_1").dtype == torch.float32


@pytest.mark.parametrize("op,category", [("sum_1", Category.INFER), ("var", Category.DENY)])
def test_under_bfloat16_only_sum_and_mean_stay_low_when_large(op, category):
    """bfloat16 has float32's range: a large sum stays INFER (rule "shape:large-reduction",
    the record says why); a large var is still DENY."""
    gm, _ = run(sums, (torch.randn(8, 16),), dtype=torch.bfloat16, reduction_threshold=12, **REDUCTIONS)
    assert (rec(gm, op).category, rec(gm, op).rule) == (category, "shape:large-reduction")


def test_without_shapes_the_size_is_unknown_and_float32():
    """No example inputs: every table reduction is DENY float32 with rule "shape:size-unknown"."""
    gm, _ = run(sums, dtype=torch.bfloat16, **REDUCTIONS)
    for name in ("sum_1", "sum_2", "cumsum", "var"):
        d = rec(gm, name)
        assert (d.category, d.dtype, d.rule) == (Category.DENY, torch.float32, "shape:size-unknown"), name
    assert "no example_inputs" in rec(gm, "sum_1").reason


def test_symbolic_sizes_are_decided_by_their_bounds():
    """With ``dynamic_dims={0: "batch"}`` (batch >= 2) and threshold 1000: ``sum(-1)`` over
    512 is small for every batch; ``sum()`` over 512*batch >= 1024 is large; ``sum(0)``
    over batch straddles the threshold, so its size is unknown."""
    gm, _ = run(lambda x: (x.sum(), x.sum(-1), x.sum(0)), (torch.randn(8, 512),), dtype=torch.float16,
                dynamic_dims={0: "batch"}, reduction_threshold=1000, **REDUCTIONS)
    assert [rec(gm, n).rule for n in ("sum_1", "sum_2", "sum_3")] == [
        "shape:large-reduction", "shape:small-reduction", "shape:size-unknown"]
    assert "512*batch" in rec(gm, "sum_1").reason


def test_only_decisions_straight_from_the_table_are_refined():
    """A reduction moved by a list edit keeps that edit: sum added to the deny list by
    argument stays DENY "argument" even though it is small."""
    gm, _ = run(lambda x: x.sum(), (torch.randn(4, 4),), dtype=torch.bfloat16, denylist_add=("sum",),
                inferlist_remove=("sum",), **REDUCTIONS)
    assert (rec(gm, "sum_1").category, rec(gm, "sum_1").rule) == (Category.DENY, "argument")


def test_reduced_count_is_elements_per_output():
    """``reduced_count``: input elements over output elements; for a same-shape scan
    (cumsum) the size of the scanned dim; a sympy expression for symbolic sizes;
    ``None`` without shapes."""
    fn = lambda x: (x.mean(dim=1, keepdim=True), torch.cumsum(x, dim=1), x.sum())  # noqa: E731
    gm, _ = run(fn, (torch.randn(6, 10),), upto=reductions.decide_reductions)
    assert [reduced_count(node(gm, n)) for n in ("mean", "cumsum", "sum_1")] == [10, 10, 60]
    gm, _ = run(fn, (torch.randn(6, 10),), dynamic_dims={0: "batch"}, upto=reductions.decide_reductions)
    assert reduced_count(node(gm, "sum_1")) == 10 * sympy.Symbol("batch", integer=True, positive=True)
    gm, _ = run(fn, upto=reductions.decide_reductions)
    assert reduced_count(node(gm, "sum_1")) is None


@pytest.mark.xfail(strict=True, reason="reduced_count divides the first operand's elements by the output's: "
                                       "for cdist(a[2, 30], b[5, 30]) that is 60/10 = 6, not the 30 each "
                                       "output sums, so a large distance reduction is judged small")
def test_two_operand_norms_count_the_reduced_dimension():
    """``torch.cdist(a, b)`` (a norm-table op) reduces the feature dim (30) into each output;
    over threshold 20 that is a large reduction: DENY float32."""
    gm, _ = run(lambda a, b: torch.cdist(a, b), (torch.randn(2, 30), torch.randn(5, 30)), dtype=torch.float16,
                reduction_threshold=20, **REDUCTIONS)
    assert reduced_count(node(gm, "cdist")) == 30
    assert (rec(gm, "cdist").category, rec(gm, "cdist").rule) == (Category.DENY, "shape:large-reduction")
