"""What torch.autocast would do, on every record (Decision.autocast), and Report.autocast_diff().

Three layers: the table (ampfx.ops.autocast_lists) against the installed torch (its dispatcher, and each op
run under real CPU autocast and CUDA autocast on fake CUDA tensors); the analysis (passes/autocast.py)
against the captured graph run node by node under real CPU autocast; the report's views of it.
"""
from __future__ import annotations

import doctest
import operator
import json
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_leaves

import ampfx
from ampfx import ops
from ampfx.ops import autocast_lists
from ampfx.ops.autocast_lists import AMBIGUOUS, COMPOSITE, FLOAT32_KINDS, LISTS, Cast
from ampfx.capture import ladder
from ampfx.runtime.graph_module import graph_module
from ampfx.inputs import ExampleInputs
from ampfx.meta import AUTOCAST
from ampfx.passes import autocast as ac_pass
from ampfx.passes import shapes
from ampfx.passes.context import PassContext
from ampfx.report.records import AutocastDiff, computes_in, dtype_name
from conftest import DTYPES

pytestmark = pytest.mark.usefixtures("one_thread")
KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


# ------------------------------------------------------------------ the table against the installed torch
@pytest.mark.parametrize("device", sorted(LISTS))
def test_table_names_exactly_the_ops_torch_registers_an_autocast_kernel_for(device):
    """Every ATen op (overload) with an Autocast<device> kernel in the installed torch is in the table,
    and the table names no other (a torch upgrade that adds or drops one fails here)."""
    registered = {n[len("aten::"):] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, KEYS[device])}
    listed = [n for names in LISTS[device].values() for n in names]
    assert len(listed) == len(set(listed)), "an op is on two lists"
    assert sorted(set(listed) - registered) == [] and sorted(registered - set(listed)) == []


def _t(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.rand(shape, dtype=torch.float32).add(0.5).to(dtype)


CASES: dict[str, Callable[..., Any]] = {
    # one call per ampfx op: t(*shape) makes a float tensor of the dtype under test (float32 with f32=True),
    # i(values) an int64 tensor, both on the device under test
    "linear": lambda t, i: F.linear(t(2, 4), t(3, 4)),
    "bilinear": lambda t, i: F.bilinear(t(2, 3), t(2, 3), t(4, 3, 3)),
    "matmul": lambda t, i: torch.matmul(t(2, 4), t(4, 3)),
    "mm": lambda t, i: torch.mm(t(2, 4), t(4, 3)),
    "mv": lambda t, i: torch.mv(t(2, 4), t(4)),
    "bmm": lambda t, i: torch.bmm(t(2, 2, 4), t(2, 4, 3)),
    "baddbmm": lambda t, i: torch.baddbmm(t(2, 2, 3), t(2, 2, 4), t(2, 4, 3)),
    "addmm": lambda t, i: torch.addmm(t(2, 3), t(2, 4), t(4, 3)),
    "addbmm": lambda t, i: torch.addbmm(t(2, 3), t(2, 2, 4), t(2, 4, 3)),
    "einsum": lambda t, i: torch.einsum("ij,jk->ik", t(2, 4), t(4, 3)),
    "conv1d": lambda t, i: F.conv1d(t(1, 2, 5), t(3, 2, 3)),
    "conv2d": lambda t, i: F.conv2d(t(1, 2, 5, 5), t(3, 2, 3, 3)),
    "conv3d": lambda t, i: F.conv3d(t(1, 2, 4, 4, 4), t(3, 2, 3, 3, 3)),
    "conv_transpose1d": lambda t, i: F.conv_transpose1d(t(1, 2, 5), t(2, 3, 3)),
    "conv_transpose2d": lambda t, i: F.conv_transpose2d(t(1, 2, 5, 5), t(2, 3, 3, 3)),
    "conv_transpose3d": lambda t, i: F.conv_transpose3d(t(1, 2, 3, 3, 3), t(2, 3, 2, 2, 2)),
    "convolution": lambda t, i: torch.convolution(t(1, 2, 5, 5), t(3, 2, 3, 3), None, [1, 1], [0, 0], [1, 1],
                                               False, [0, 0], 1),
    "scaled_dot_product_attention": lambda t, i: F.scaled_dot_product_attention(t(1, 2, 4, 8), t(1, 2, 4, 8),
                                                                             t(1, 2, 4, 8)),
    "prelu": lambda t, i: F.prelu(t(2, 3), t(1)),
    "multi_head_attention": lambda t, i: F.multi_head_attention_forward(
        t(3, 1, 4), t(3, 1, 4), t(3, 1, 4), 4, 1, t(12, 4), t(12), None, None, False, 0.0, t(4, 4), t(4),
        training=False, need_weights=False)[0],
    "gelu": lambda t, i: F.gelu(t(2, 3)),
    "silu": lambda t, i: F.silu(t(2, 3)),
    "tanh": lambda t, i: torch.tanh(t(2, 3)),
    "sigmoid": lambda t, i: torch.sigmoid(t(2, 3)),
    "relu": lambda t, i: F.relu(t(2, 3)),
    "softplus": lambda t, i: F.softplus(t(2, 3)),
    "add": lambda t, i: torch.add(t(2, 3), t(2, 3)),
    "mul": lambda t, i: torch.mul(t(2, 3), t(2, 3)),
    "addcmul": lambda t, i: torch.addcmul(t(2, 3), t(2, 3), t(2, 3)),
    "addcdiv": lambda t, i: torch.addcdiv(t(2, 3), t(2, 3), t(2, 3)),
    "sqrt": lambda t, i: torch.sqrt(t(2, 3)),
    "rsqrt": lambda t, i: torch.rsqrt(t(2, 3)),
    "reciprocal": lambda t, i: torch.reciprocal(t(2, 3)),
    "exp": lambda t, i: torch.exp(t(2, 3)),
    "expm1": lambda t, i: torch.expm1(t(2, 3)),
    "pow": lambda t, i: torch.pow(t(2, 3), 2.0),
    "log": lambda t, i: torch.log(t(2, 3)),
    "log1p": lambda t, i: torch.log1p(t(2, 3)),
    "log2": lambda t, i: torch.log2(t(2, 3)),
    "log10": lambda t, i: torch.log10(t(2, 3)),
    "sin": lambda t, i: torch.sin(t(2, 3)),
    "tan": lambda t, i: torch.tan(t(2, 3)),
    "softmax": lambda t, i: F.softmax(t(2, 3), -1),
    "log_softmax": lambda t, i: F.log_softmax(t(2, 3), -1),
    "sum": lambda t, i: torch.sum(t(2, 3)),
    "mean": lambda t, i: torch.mean(t(2, 3)),
    "prod": lambda t, i: torch.prod(t(2, 3)),
    "cumsum": lambda t, i: torch.cumsum(t(2, 3), 1),
    "var": lambda t, i: torch.var(t(2, 3)),
    "norm": lambda t, i: torch.norm(t(2, 3)),
    "logsumexp": lambda t, i: torch.logsumexp(t(2, 3), 1),
    "layer_norm": lambda t, i: F.layer_norm(t(2, 4), (4,), t(4, f32=True), t(4, f32=True)),
    "group_norm": lambda t, i: F.group_norm(t(2, 4, 3), 2, t(4, f32=True), t(4, f32=True)),
    "batch_norm": lambda t, i: F.batch_norm(t(2, 4, 3), t(4, f32=True), t(4, f32=True)),
    "rms_norm": lambda t, i: F.rms_norm(t(2, 4), (4,), t(4, f32=True)),
    "interpolate": lambda t, i: F.interpolate(t(1, 2, 4, 4), scale_factor=2.0, mode="bilinear"),
    "avg_pool": lambda t, i: F.avg_pool2d(t(1, 2, 4, 4), 2),
    "max_pool": lambda t, i: F.max_pool2d(t(1, 2, 4, 4), 2),
    "cat": lambda t, i: torch.cat([t(2, 3), t(2, 3)]),
    "stack": lambda t, i: torch.stack([t(2, 3), t(2, 3)]),
    "transpose": lambda t, i: t(2, 3).transpose(0, 1),
    "where": lambda t, i: torch.where(i([1, 0, 1]).bool(), t(3), t(3)),
    "dropout": lambda t, i: F.dropout(t(2, 3), 0.5, training=False),
    "embedding": lambda t, i: F.embedding(i([0, 2]), t(3, 4)),
    "mse_loss": lambda t, i: F.mse_loss(t(2, 3), t(2, 3)),
    "l1_loss": lambda t, i: F.l1_loss(t(2, 3), t(2, 3)),
    "smooth_l1_loss": lambda t, i: F.smooth_l1_loss(t(2, 3), t(2, 3)),
    "huber_loss": lambda t, i: F.huber_loss(t(2, 3), t(2, 3)),
    "cross_entropy": lambda t, i: F.cross_entropy(t(2, 3), i([0, 2])),
    "nll_loss": lambda t, i: F.nll_loss(t(2, 3), i([0, 2])),
    "binary_cross_entropy_with_logits": lambda t, i: F.binary_cross_entropy_with_logits(t(2, 3), t(2, 3)),
    "kl_div": lambda t, i: F.kl_div(t(2, 3), t(2, 3), reduction="batchmean"),
    "cosine_embedding_loss": lambda t, i: F.cosine_embedding_loss(t(2, 3), t(2, 3), t(2)),
    # Fourier transforms: complex results are read through .real (the dtype it has says what the op ran in)
    **{name: (lambda fn: lambda t, i: fn(t(2, 8)).real)(getattr(torch.fft, name))
       for name in ("ifft", "fft2", "ifft2", "fftn", "ifftn", "rfft2", "rfftn", "irfft2", "irfftn", "hfft", "ihfft")},
}


CASE_ATEN = {"avg_pool": "avg_pool2d", "max_pool": "max_pool2d"}
"""The ATen op a case of an op :func:`~ampfx.ops.autocast_lists.kind_of_op` calls ambiguous runs."""


def _makers(dtype: torch.dtype, mode: FakeTensorMode | None) -> tuple[Callable, Callable]:
    """``t`` and ``i`` of :data:`CASES`: real CPU tensors, or with ``mode`` fake CUDA tensors (CUDA autocast
    runs its real dtype rules on them with no GPU: the AutocastCUDA key is in a fake CUDA tensor's key set)."""
    def place(x: torch.Tensor) -> torch.Tensor:
        return x if mode is None else FakeTensor(mode, x.to("meta"), torch.device("cuda"))

    return (lambda *shape, f32=False: place(_t(shape, torch.float32 if f32 else dtype)),
            lambda values: place(torch.tensor(values)))


def _out_dtype(device: str, low: torch.dtype, op: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``CASES[op]`` returns under ``torch.autocast(device, low)`` with ``dtype`` inputs."""
    out = None
    if device == "cpu":
        with torch.autocast("cpu", dtype=low), torch.no_grad():
            out = CASES[op](*_makers(dtype, None))
    else:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        prev = torch.get_autocast_dtype("cuda"), torch.is_autocast_enabled("cuda")
        torch.set_autocast_dtype("cuda", low)
        torch.set_autocast_enabled("cuda", True)
        try:
            with mode, torch.no_grad():
                out = CASES[op](*_makers(dtype, mode))
        finally:
            torch.set_autocast_dtype("cuda", prev[0])
            torch.set_autocast_enabled("cuda", prev[1])
    return next(t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dtype.is_floating_point)


def test_every_op_the_table_lists_for_an_ampfx_op_has_a_case():
    """The kind checks below cover every ampfx op the table gives a kind (ops autocast lists)."""
    listed = {op for device in LISTS for op in ops.ENTRIES
              if autocast_lists.kind_of_op(device, op) not in (None, AMBIGUOUS) and op not in COMPOSITE}
    assert sorted(listed - set(CASES) - {"lstm_cell", "gru_cell", "rnn_cell", "ctc_loss", "binary_cross_entropy",
                                         "poisson_nll_loss", "margin_ranking_loss", "triplet_margin_loss",
                                         "multi_margin_loss", "soft_margin_loss", "hinge_embedding_loss",
                                         "stft"}) == []  # stft: on fake CUDA tensors bfloat16 in gives complex64


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # rms_norm's unfused path
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("low", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("op", sorted(CASES))
def test_each_ops_kind_matches_what_autocast_does(device, low, op):
    """float32 inputs: a lower_precision_fp op returns the low dtype, every other op float32 (an op
    not in the table keeps float32 in -> float32 out). Low inputs: a float32-list op returns float32,
    every other op the low dtype. CPU runs real autocast; CUDA runs CUDA autocast on fake CUDA tensors."""
    kind = autocast_lists.kind_of_op(device, op)
    if kind == AMBIGUOUS:  # the case calls one of the op's ATen ops: that one's kind
        kind = autocast_lists.kind_of_aten(device, CASE_ATEN[op])
    try:
        from_fp32 = _out_dtype(device, low, op, torch.float32)
        from_low = _out_dtype(device, low, op, low)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"{op} has no {dtype_name(low)} kernel on {device} here: {str(e)[:80]}")
    assert from_fp32 == (low if kind is Cast.LOWER else torch.float32), kind
    assert from_low == (torch.float32 if kind in FLOAT32_KINDS else low), kind


def test_cuda_rows_on_a_real_gpu():
    """Where a GPU is present, the CUDA rows hold on it too (softmax float32, linear low)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA rows are checked on fake CUDA tensors above")
    x = torch.randn(2, 4, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        assert F.linear(x, x).dtype == torch.float16 and F.softmax(x.half(), -1).dtype == torch.float32


# ------------------------------------------------------------------ the analysis against real autocast
class Block(nn.Module):
    """GEMMs, softmax, norms, pointwise ops, a 0-dim float32 scale and a float32 residual applied to low
    values, losses."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.ln, self.act = nn.LayerNorm(8), nn.GELU()
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.fc2(self.act(self.fc1(x))) * self.scale  # low under autocast: a 0-dim float32 does not promote
        h = self.ln(h + x)  # bfloat16 + float32: promotes to float32
        att = torch.softmax(torch.matmul(h, h.transpose(-1, -2)) / 8 ** 0.5, dim=-1)
        y = torch.matmul(att, h) * torch.sigmoid(att).mean(-1, keepdim=True) + F.gelu(h).sum(-1, keepdim=True)
        return F.mse_loss(y, target) + F.cross_entropy(y.mean(1), target.argmax(-1)[:, 0])


class ConvNet(nn.Module):
    """Convolutions with batch, group and layer norm, pooling, a residual, a classifier and its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.gn = nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv1(x)))
        h = F.silu(self.gn(self.conv2(h))) + h
        h = F.adaptive_avg_pool2d(h, 1).flatten(1)
        logits = self.head(F.layer_norm(h, (8,)))
        return F.cross_entropy(logits, labels) + torch.exp(logits).mean()


class Encoder(nn.Module):
    """A transformer encoder (attention as a leaf, residuals, layer norms) and a mean-pooled head."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc, self.head = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x).mean(1))


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    "encoder": lambda: (Encoder().eval(), (torch.randn(2, 5, 8),)),
    "block": lambda: (Block(), (torch.randn(2, 4, 8), torch.randn(2, 4, 8))),
    "convnet": lambda: (ConvNet().eval(), (torch.randn(2, 3, 6, 6), torch.tensor([1, 3]))),
}


class _Record(fx.Interpreter):
    """Runs a graph and keeps the dtype of each node's first float output."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.seen: dict[str, torch.dtype | None] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        floats = [t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dtype.is_floating_point]
        if n.op != "output":
            self.seen[n.name] = floats[0] if floats else None
        return out


def _captured(model: nn.Module, inputs: tuple, tracer: str = "auto") -> fx.GraphModule:
    capture = ladder.capture(model, ampfx.Policy(), ExampleInputs.of(inputs), tracer)
    return graph_module(model, capture.graph)


def _under_autocast(gm: fx.GraphModule, inputs: tuple, low: torch.dtype) -> dict[str, torch.dtype | None]:
    """Each node's output dtype when the graph (the model's own ops) runs under real CPU autocast."""
    rec = _Record(gm)
    with torch.autocast("cpu", dtype=low), torch.no_grad():
        rec.run(*inputs)
    return rec.seen


@pytest.mark.parametrize("low", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("with_shapes", [True, False], ids=["shapes", "no-shapes"])
def test_analysis_gives_each_node_the_dtype_real_cpu_autocast_computes(name, low, with_shapes):
    """The analysis, on the captured graph before casts (with example inputs or without), gives every
    node the dtype its op returns when the graph runs under torch.autocast("cpu", low): GEMMs and
    convolutions low, softmax/norms/pointwise following their inputs, bfloat16 + float32 promoted,
    losses float32, non-float values None."""
    model, inputs = MODELS[name]()
    gm = _captured(model, inputs)
    seen = _under_autocast(gm, inputs, low)
    if with_shapes:
        shapes.propagate(gm, inputs)
    ac_pass.annotate_autocast(gm, PassContext(ampfx.Policy(dtype=low), device="cpu"))
    got = {n.name: n.meta[AUTOCAST] for n in gm.graph.nodes if n.op != "output"}
    if not with_shapes:  # without shapes, non-float values cannot be told apart: compare float values only
        got = {k: v for k, v in got.items() if seen[k] is not None}
        seen = {k: v for k, v in seen.items() if v is not None}
    assert got == seen
    assert {low, torch.float32} <= set(seen.values())  # the models exercise both


@pytest.mark.parametrize("low", DTYPES, ids=dtype_name)
def test_exported_graph_nodes_get_the_dtype_real_cpu_autocast_computes(low):
    """On a torch.export graph (ATen overloads) the exact overload is looked up: same agreement."""
    model, inputs = MODELS["block"]()
    gm = _captured(model, inputs, tracer="export")
    assert any(isinstance(n.target, torch._ops.OpOverload) for n in gm.graph.nodes)
    seen = _under_autocast(gm, inputs, low)
    shapes.propagate(gm, inputs)
    ac_pass.annotate_autocast(gm, PassContext(ampfx.Policy(dtype=low), device="cpu"))
    assert {n.name: n.meta[AUTOCAST] for n in gm.graph.nodes if n.op != "output"} == seen


# ------------------------------------------------------------------ the report
def _converted(name: str, low: torch.dtype) -> tuple[ampfx.report.Report, dict[str, torch.dtype | None]]:
    model, inputs = MODELS[name]()
    seen = _under_autocast(_captured(model, inputs), inputs, low)
    # one graph, compared node by node with the model's own trace: blocks traced through, not kept
    return ampfx.convert(model, low, example_inputs=inputs, keep_modules=()).ampfx_report, seen


@pytest.mark.parametrize("low", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_records_carry_autocasts_dtype_and_the_diff_lists_exactly_the_differing_nodes(name, low):
    """After convert, each record of a model's own node carries the dtype real CPU autocast computes it
    in (nodes ampfx inserted carry None); autocast_diff() is exactly the compute nodes where ampfx's
    dtype is another, each with the record's rule and reason, and the summary line counts them."""
    rep, seen = _converted(name, low)
    own = [r for r in rep.records if r.node in seen]
    assert len(own) == len(seen) and all(r.autocast == seen[r.node] for r in own)
    assert all(r.autocast is None for r in rep.records if r.node not in seen)
    want = [(r.node, computes_in(r), seen[r.node], r.rule, r.reason) for r in rep.compute
            if r.node in seen and seen[r.node] is not None and computes_in(r) != seen[r.node]]
    diff = rep.autocast_diff()
    assert [(d.node, d.dtype, d.autocast, d.rule, d.reason) for d in diff] == want
    assert bool(want) == (name != "encoder")  # block and convnet keep deny ops float32; the encoder agrees
    assert rep.autocast_summary().startswith(f"differs from autocast on {len(want)}/{len(rep.compute)} nodes")


def test_softmax_kept_float32_is_the_one_difference_of_linear_softmax():
    """Linear + Softmax in bfloat16 on CPU: autocast runs both in bfloat16 (softmax is on no CPU list);
    ampfx keeps softmax float32 by its deny list: that node, with that rule and reason, and nothing else."""
    m = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1))
    rep = ampfx.convert(m, "bf16", example_inputs=torch.randn(2, 4)).ampfx_report
    (d,) = rep.autocast_diff()
    assert (d.op, d.dtype, d.autocast, d.rule) == ("softmax", torch.float32, torch.bfloat16, "table")
    assert d.reason == rep.by_node(d.node).reason and "overflow" in d.reason
    assert rep.autocast_summary() == "differs from autocast on 1/2 nodes: softmax 1 (fp32/bf16, deny list)"


def test_json_carries_autocast_and_round_trips(tmp_path):
    """as_json writes autocast as a dtype name ("unknown", null as they are); decisions.jsonl holds it;
    the diff records serialise and read back equal."""
    rep, _ = _converted("block", torch.bfloat16)
    rows = [json.loads(line) for line in (rep.save(tmp_path) / "decisions.jsonl").read_text().splitlines()]
    assert [row["autocast"] for row in rows] == [
        dtype_name(r.autocast) if isinstance(r.autocast, torch.dtype) else r.autocast for r in rep.records]
    assert {"bfloat16", "float32", None} <= {row["autocast"] for row in rows}
    for d in rep.autocast_diff():
        j = json.loads(json.dumps(d.as_json()))
        assert j == d.as_json() and j["dtype"] == dtype_name(d.dtype) and j["autocast"] == dtype_name(d.autocast)
        assert AutocastDiff(**{**j, "dtype": d.dtype, "autocast": d.autocast}) == d


def test_html_page_lists_the_diff_and_an_autocast_column():
    """The HTML report has a 'Differs from torch.autocast' table whose rows are autocast_diff(), an
    autocast column in the decisions table, and the summary line in its header."""
    from test_html import Tags
    rep, _ = _converted("convnet", torch.bfloat16)
    page = rep.html()
    tags = Tags(page)
    assert [tuple(r[:5]) for r in tags.rows["autocast-diff"][1:]] == [
        (d.node, d.op, d.module, dtype_name(d.dtype), dtype_name(d.autocast)) for d in rep.autocast_diff()]
    assert [r[6] for r in tags.rows["decisions"][1:]] == [dtype_name(r.autocast) for r in rep.records]
    assert f"Differs from torch.autocast ({len(rep.autocast_diff())})" in page
    assert rep.autocast_summary() in page


def test_table_shows_an_autocast_column_on_request_marking_differences():
    """table(autocast=True) adds the column, marking differing rows with '≠'; the default table is as before."""
    m = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1))
    rep = ampfx.convert(m, "bf16", example_inputs=torch.randn(2, 4)).ampfx_report
    plain, wide = rep.table(width=200), rep.table(width=200, autocast=True)
    assert "autocast" not in plain and "≠" not in plain
    rows = {line.split("│")[1].strip(): line for line in wide.splitlines() if line.count("│") > 5}
    header = next(line for line in wide.splitlines() if "node" in line)
    assert "┃ autocast" in header and "≠ bfloat16" in rows["softmax"] and "≠" not in rows["linear"]


# ------------------------------------------------------------------ what cannot be known
def tanh(x: torch.Tensor) -> torch.Tensor:
    """A function of the model's own, named like an ATen op, that fx keeps whole (torch.fx.wrap)."""
    return (x * 1.5).to(torch.float64).tanh().float()


torch.fx.wrap("tanh")


@torch.library.custom_op("ampfx_test::scale", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    """A custom op: autocast has no list entry for it, and ampfx cannot know its dtype rule."""
    return x.float() * 2


@scale.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.float32)


class Foreign(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tanh(self.fc(x)) + torch.ops.ampfx_test.scale(self.fc(x)) + torch.ops.aten.exp(x).sum()


def test_a_model_function_named_like_an_aten_op_and_a_custom_op_are_unknown():
    """A function of the model's kept whole is opaque even when its name is an ATen op's ('tanh'), and so
    is a custom op (torch.ops.<namespace>): 'unknown', never a guess from the name. (tracer='fx' keeps a
    torch.fx.wrap-ped function whole; 'auto' traces into it.)"""
    gm = _captured(Foreign(), (torch.randn(2, 4),), tracer="fx")
    ac_pass.annotate_autocast(gm, PassContext(ampfx.Policy(dtype=torch.bfloat16), device="cpu"))
    by_target = {getattr(n.target, "__name__", str(n.target)): n.meta.get(AUTOCAST) for n in gm.graph.nodes}
    assert by_target["tanh"] == ac_pass.UNKNOWN and by_target["scale"] == ac_pass.UNKNOWN
    assert by_target["linear"] == torch.bfloat16 and by_target["add"] == ac_pass.UNKNOWN
    assert by_target["exp"] == torch.float32  # torch.ops.aten.exp (a packet) is looked up as ATen's exp


class Opaque(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class WithOpaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.inner, self.rnn = nn.Linear(4, 4), Opaque(), nn.GRU(4, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(self.fc(x))
        return self.rnn(h)[0].relu() + torch.linalg.multi_dot([x[0], x[0].t(), x[0]])


def test_opaque_leaves_recurrent_modules_and_unlisted_composites_are_unknown_and_left_out_of_the_diff():
    """A user module kept as a leaf, a GRU (its dtype comes from the GEMMs inside it), an unlisted
    composite op ampfx has no entry for (linalg.multi_dot runs mm) are 'unknown', and so are unlisted ops
    on their values; autocast_diff() leaves them out and the summary counts them."""
    rep = ampfx.convert(WithOpaque(), "bf16", example_inputs=torch.randn(2, 3, 4),
                        leaf_modules=[Opaque]).ampfx_report
    by_op = {r.op: r.autocast for r in rep.compute}
    assert by_op["linear"] == torch.bfloat16
    unknown = {r.op for r in rep.autocast_unknown()}
    assert {"gru", "relu", "add"} <= unknown and any("Opaque" in op for op in unknown)
    assert any("multi_dot" in op for op in unknown)
    assert not {d.node for d in rep.autocast_diff()} & {r.node for r in rep.autocast_unknown()}
    assert rep.autocast_summary().endswith(f"autocast's dtype unknown for {len(rep.autocast_unknown())}")


def test_a_device_without_an_autocast_table_reports_nothing():
    """On a device the table does not cover, no node gets an autocast dtype and the summary says so."""
    model, inputs = MODELS["block"]()
    gm = _captured(model, inputs)
    ac_pass.annotate_autocast(gm, PassContext(ampfx.Policy(dtype=torch.bfloat16), device="mps"))
    assert not any(AUTOCAST in n.meta for n in gm.graph.nodes)
    assert ampfx.report.Report(torch.bfloat16).autocast_summary().startswith("autocast: not compared")


def test_user_float32_region_runs_as_written():
    """Ops under torch.autocast(enabled=False) in the model run without autocast: a linear there computes
    in its inputs' dtype (float32), as ampfx's user-float32 rule has it: no difference reported."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                y = self.b(x)
            return self.a(x) + y

    rep = ampfx.convert(M(), "bf16", example_inputs=torch.randn(2, 4)).ampfx_report
    fp32 = [r for r in rep.compute if r.rule == "user-float32"]
    assert fp32 and all(r.autocast == torch.float32 for r in fp32)
    assert not [d for d in rep.autocast_diff() if d.rule == "user-float32"]


def test_the_analysis_docstrings_hold():
    """passes/ is not collected for doctests: run the analysis module's here."""
    assert doctest.testmod(ac_pass).failed == 0


def test_cli_explain_autocast_diff(capsys):
    """`ampfx explain --autocast-diff` prints the summary line and the autocast column; with --format json
    one line per differing node, the same as autocast_diff()."""
    from ampfx.ui.cli import main
    args = ["explain", "tests/test_autocast_diff.py:Block", "--input", "2,4,8", "--input", "2,4,8", "--autocast-diff"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "differs from autocast on" in text and "┃ autocast" in text and "≠" in text
    assert main([*args, "--format", "json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    torch.manual_seed(0)
    model, inputs = MODELS["block"]()
    rep = ampfx.convert(model, "bf16", example_inputs=inputs).ampfx_report
    assert [r["node"] for r in rows] == [d.node for d in rep.autocast_diff()] and rows


def test_attention_output_is_low_and_its_weights_unknown():
    """An attention leaf's first output is its output projection's (low under autocast); the attention
    weights, its second output, come from a softmax whose list differs by device: unknown."""
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            out, weights = self.attn(x, x, x)
            return out, weights

    gm = _captured(Attn().eval(), (torch.randn(2, 3, 8),))
    ac_pass.annotate_autocast(gm, PassContext(ampfx.Policy(dtype=torch.float16), device="cpu"))
    got = [n.meta[AUTOCAST] for n in gm.graph.nodes if n.target is operator.getitem]
    assert got == [torch.float16, ac_pass.UNKNOWN]


# ------------------------------------------------------------------ the autocast field
class DtypeArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return torch.softmax(h, -1, dtype=torch.float32) + 1, h.cumsum(0, dtype=torch.float32) * 2


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_dtype_argument_decides_the_autocast_dtype_in_exported_graphs_too(tracer):
    """torch.export passes dtype= by position (aten.softmax.int(h, -1, torch.float32)): the analysis read
    only keywords and said bfloat16 where autocast computes float32."""
    x = torch.randn(4, 8)
    report = ampfx.convert(DtypeArgs(), "bf16", example_inputs=(x,), tracer=tracer).ampfx_report
    got = {r.op: r.autocast for r in report.records if r.op in ("softmax", "cumsum")}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s, c = DtypeArgs()(x)
    assert got == {"softmax": torch.float32, "cumsum": torch.float32} and s.dtype == c.dtype == torch.float32
