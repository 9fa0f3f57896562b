"""The op tables: one name per op, a reason per entry, coverage of the ops users hit."""
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampfx import Category
from ampfx.ops import ENTRIES, aliases_of, lookup_name

REQUIRED = """linear matmul mm bmm baddbmm addmm einsum conv1d conv2d conv3d conv_transpose1d conv_transpose2d
conv_transpose3d scaled_dot_product_attention multi_head_attention lstm gru embedding relu gelu silu tanh sigmoid
elu leaky_relu hardswish softplus add sub mul div cat stack view reshape permute transpose flatten squeeze unsqueeze
getitem chunk split contiguous dropout max_pool avg_pool batch_norm layer_norm group_norm rms_norm softmax
log_softmax exp log pow sqrt rsqrt sum mean var std norm cumsum prod logsumexp cross_entropy nll_loss mse_loss
l1_loss smooth_l1_loss binary_cross_entropy_with_logits kl_div where masked_fill interpolate""".split()


@pytest.mark.parametrize("name", REQUIRED)
def test_required_op_has_an_entry_with_a_reason(name):
    """Every op the core issue names is in a table and says why it is where it is."""
    rule = ENTRIES[name]
    assert len(rule.reason) > 20, rule


@pytest.mark.parametrize("keys,name", [
    ((nn.Linear, F.linear, "linear", torch.ops.aten.linear.default), "linear"),
    ((nn.Softmax, F.softmax, torch.softmax, "softmax", torch.ops.aten._softmax.default), "softmax"),
    ((operator.add, torch.add, "add", "add_", "__add__"), "add"),
    ((nn.BatchNorm2d, F.batch_norm, torch.ops.aten._native_batch_norm_legit.default), "batch_norm"),
    ((nn.LayerNorm, F.layer_norm, torch.ops.aten.native_layer_norm.default), "layer_norm"),
    ((operator.matmul, torch.matmul, "matmul"), "matmul"),
    ((torch.ops.aten.sum.dim_IntList, torch.sum, "sum"), "sum"),
    ((nn.LSTM,), "lstm"),
    ((F.relu_, "relu_", nn.ReLU), "relu"),
    ((F.glu, nn.GLU, torch.ops.aten.glu.default), "glu"),
    ((F.threshold, nn.Threshold, F.hardshrink, nn.Hardshrink, torch.ops.aten.hardshrink.default), "threshold"),
    ((F.unfold, nn.Unfold, torch.ops.aten.im2col.default), "im2col"),
    ((F.fold, nn.Fold, torch.ops.aten.col2im.default), "fold"),
    ((F.pixel_shuffle, nn.PixelShuffle), "pixel_shuffle"),
    ((F.cosine_similarity, nn.CosineSimilarity), "normalize"),
    ((F.pairwise_distance, nn.PairwiseDistance), "norm"),
])
def test_function_method_module_and_aten_forms_share_one_name(keys, name):
    """The same op reached as a function, a method, a module or an ATen overload is one op."""
    assert {lookup_name(k) for k in keys} == {name}


def test_subclasses_of_listed_modules_match():
    class MyLinear(nn.Linear):
        pass
    assert lookup_name(MyLinear) == "linear"


def test_unknown_keys_are_none():
    assert lookup_name(lambda x: x) is None and lookup_name("frobnicate") is None


@pytest.mark.parametrize("name,fp16,bf16", [
    ("sum", Category.DENY, Category.INFER),
    ("mean", Category.DENY, Category.INFER),
    ("rsqrt", Category.DENY, Category.INFER),
    ("pow", Category.DENY, Category.INFER),
    ("exp", Category.DENY, Category.DENY),
    ("softmax", Category.DENY, Category.DENY),
    ("linear", Category.ALLOW, Category.ALLOW),
])
def test_range_sensitive_ops_differ_by_dtype(name, fp16, bf16):
    """float16 overflows at 65504; bfloat16 has float32's range, so reductions may stay low."""
    assert ENTRIES[name].for_dtype(torch.float16)[0] is fp16
    assert ENTRIES[name].for_dtype(torch.bfloat16)[0] is bf16


def test_aliases_are_listed_for_docs():
    assert nn.Linear in aliases_of("linear") and F.linear in aliases_of("linear")
