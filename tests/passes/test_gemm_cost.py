"""``passes/gemm_cost.py``: GEMMs whose forward FLOPs are under the device's break-even for the low dtype stay
float32 (rule ``cost:small-gemm``); larger ones, unknown sizes and list edits are left as they are."""
import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx import Category
from ampfx.ops import gemm_cost as table
from ampfx.passes import gemm_cost

from .helpers import node, rec, run

COST = dict(upto=gemm_cost.keep_small_gemms)


class Mixed(nn.Module):
    """A small linear (2*8*16*16 = 4,096 FLOPs), a large one (2*8*16*512 = 131,072), a convolution
    (2*(2*4*6*6)*(3*3*3) = 15,552), a batched product (2*(2*8*16)*16 = 8,192) and attention."""

    def __init__(self):
        super().__init__()
        self.small, self.large = nn.Linear(16, 16), nn.Linear(16, 512)
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x, img, q):
        a = self.small(x)
        b = self.large(x)
        c = self.conv(img)
        d = torch.matmul(x.unsqueeze(0).expand(2, 8, 16), a.t())
        e = F.scaled_dot_product_attention(q, q, q)
        return a, b, c, d, e


INPUTS = (torch.randn(8, 16), torch.randn(2, 3, 8, 8), torch.randn(1, 2, 4, 8))


def test_flops_are_counted_from_the_weights_and_operands():
    """2 * numel(output) * K: a linear's K is its weight's in_features, a convolution's C_in / groups times its
    kernel, a product's its first operand's last size; attention 2 * L * S * (E + Ev) per batch and head."""
    gm, _ = run(Mixed(), INPUTS, **COST)
    got = {n: int(gemm_cost.flops(node(gm, n), gm)) for n in ("small", "large", "conv", "matmul",
                                                              "scaled_dot_product_attention")}
    assert got == {"small": 4096, "large": 131072, "conv": 15552, "matmul": 2 * 2 * 8 * 8 * 16,
                   "scaled_dot_product_attention": 2 * 2 * 4 * 4 * 16}


def test_a_gemm_under_the_break_even_stays_float32_and_says_why():
    """With gemm_min_flops=10,000: the small linear, the product and attention are DENY float32 (rule
    cost:small-gemm, their FLOPs and the break-even in the reason); the large linear and the convolution stay on
    the allow list."""
    gm, _ = run(Mixed(), INPUTS, gemm_min_flops=10_000, **COST)
    small = rec(gm, "small")
    assert (small.category, small.dtype, small.rule) == (Category.DENY, torch.float32, "cost:small-gemm")
    assert "4,096 FLOPs a call, under 10,000" in small.reason and "gemm_min_flops" in small.reason
    assert rec(gm, "matmul").rule == rec(gm, "scaled_dot_product_attention").rule == "cost:small-gemm"
    assert [(rec(gm, n).category, rec(gm, n).rule) for n in ("large", "conv")] == [(Category.ALLOW, "table")] * 2


def test_the_break_even_comes_from_the_device_and_zero_lowers_every_gemm(monkeypatch):
    """Not given, the break-even is the device type's table entry (a CPU's here, none for cuda); 0 lowers every
    GEMM whatever the device."""
    monkeypatch.setattr(table, "BREAK_EVEN", {"cpu": table.BreakEven(20_000, 0)})
    gm, _ = run(Mixed(), INPUTS, **COST)
    assert [rec(gm, n).rule for n in ("small", "conv", "large")] == ["cost:small-gemm", "cost:small-gemm", "table"]
    assert "the break-even of bfloat16 GEMMs on cpu" in rec(gm, "small").reason
    gm, _ = run(Mixed(), INPUTS, device="cuda:0", **COST)
    assert rec(gm, "small").rule == "table"
    gm, _ = run(Mixed(), INPUTS, gemm_min_flops=0, **COST)
    assert rec(gm, "small").rule == "table"


def test_unknown_sizes_are_left_alone_and_symbolic_ones_decided_at_the_example_with_their_condition():
    """Without example inputs nothing is known; a symbolic size is decided at its example value (2*16*16*batch at
    batch 8: 4,096 FLOPs), and the node records the factor of the example's elements from which it pays."""
    gm, _ = run(Mixed(), gemm_min_flops=10**9, **COST)
    assert rec(gm, "small").rule == "table"
    gm, _ = run(nn.Linear(16, 16), (torch.randn(8, 16),), dynamic_dims={0: "batch"}, gemm_min_flops=4097, **COST)
    f = gemm_cost.flops(node(gm, "linear"), gm)
    assert isinstance(f, sympy.Expr) and not f.is_number
    assert rec(gm, "linear").rule == "cost:small-gemm"  # 4,096 at batch 8; 512*batch reaches 4,097 from batch 9
    assert node(gm, "linear").meta["ampfx_cost_scale"] == pytest.approx(4097 / 4096)
    assert "512*batch (= 4,096 here)" in rec(gm, "linear").reason


def test_convert_keeps_small_gemms_float32_and_the_numbers_are_float32s():
    """Through convert: a model of small layers on a CPU with the break-even given keeps every GEMM float32,
    inserts no casts, and returns what the float32 model returns."""
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,), gemm_min_flops=10**6)
    assert len(amp.ampfx_report.casts) == 0
    assert {r.rule for r in amp.ampfx_report.records if r.op == "linear"} == {"cost:small-gemm"}
    torch.testing.assert_close(amp(x), model(x))
    assert "small GEMM" in amp.ampfx_report.summary()


def test_a_recurrent_module_counts_one_time_step_of_each_weight_matrix():
    """nn.GRU(8, 16, num_layers=2) over 5 steps of 3 rows on a CPU: torch runs its GEMMs a step at a time, each over
    the batch of 3: 2 * 3 * (3*16*8 + 3*16*16 + 3*16*16 + 3*16*16), the same for 5 steps or 500 (many small GEMMs
    do not pay low where one large one would); batch first, the batch is the first size. An LSTM, which oneDNN runs
    as one kernel over the sequence, counts every step."""
    class Recurrent(nn.Module):
        def __init__(self, batch_first=False):
            super().__init__()
            self.rnn = nn.GRU(8, 16, num_layers=2, batch_first=batch_first)

        def forward(self, x):
            return self.rnn(x)[0]

    per_step = 2 * 3 * (3 * 16 * 8 + 3 * 3 * 16 * 16)
    for model, x in ((Recurrent(), torch.randn(5, 3, 8)), (Recurrent(), torch.randn(500, 3, 8)),
                     (Recurrent(batch_first=True), torch.randn(3, 50, 8))):
        gm, _ = run(model, (x,), gemm_min_flops=10**9, **COST)
        rnn = next(n for n in gm.graph.nodes if n.op == "call_module")
        assert int(gemm_cost.flops(rnn, gm)) == per_step
        assert rec(gm, rnn.name).rule == "cost:small-gemm"
    if torch.backends.mkldnn.is_available():
        class Long(nn.Module):
            def __init__(self):
                super().__init__()
                self.rnn = nn.LSTM(8, 16)

            def forward(self, x):
                return self.rnn(x)[0]

        gm, _ = run(Long(), (torch.randn(5, 3, 8),), gemm_min_flops=10**9, **COST)
        rnn = next(n for n in gm.graph.nodes if n.op == "call_module")
        assert int(gemm_cost.flops(rnn, gm)) == 2 * 15 * (4 * 16 * 8 + 4 * 16 * 16)


def test_the_break_even_is_read_from_the_environment_and_a_bad_one_is_refused():
    """AMPFX_GEMM_MIN_FLOPS takes a whole number (underscores and commas allowed) or auto (the device's), and so
    does gemm_min_flops; a negative, fractional or boolean one, or another word, is an error naming the option."""
    import pytest

    from ampfx.errors import PolicyError
    from ampfx.policy import Policy, from_env

    assert from_env(Policy(), {"AMPFX_GEMM_MIN_FLOPS": "1_000"}).gemm_min_flops == 1000
    assert from_env(Policy(gemm_min_flops=5), {"AMPFX_GEMM_MIN_FLOPS": "auto"}).gemm_min_flops is None
    with pytest.raises(PolicyError, match="AMPFX_GEMM_MIN_FLOPS='lots'"):
        from_env(Policy(), {"AMPFX_GEMM_MIN_FLOPS": "lots"})
    assert Policy(gemm_min_flops="auto").gemm_min_flops is None
    for bad in (-1, 1.5, True, "lots"):
        with pytest.raises(PolicyError, match="gemm_min_flops="):
            Policy(gemm_min_flops=bad)


def test_a_bounded_symbolic_count_is_decided_by_its_bound_and_written_with_it():
    """A linear over at most 4 rows of a dynamic batch (``x[:min(batch, 4)]``): at most 2*4*16*16 = 2,048
    FLOPs, under the break-even for every batch; the reason writes the expression and its bound."""
    class Capped(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return self.lin(x[:torch.sym_min(x.shape[0], 4)])

    amp = ampfx.convert(Capped(), "bf16", example_inputs=(torch.randn(8, 16),), dynamic_dims={0: "batch"},
                        gemm_min_flops=10_000)
    d = next(r for r in amp.ampfx_report.records if r.op == "linear")
    assert d.rule == "cost:small-gemm" and "(= 2,048 here)" in d.reason, d.reason


def test_under_fp8_the_device_break_even_is_not_applied_and_forced_fp8_linears_are_never_kept():
    """fp8= plans for its roofline's GPU: no CPU break-even (every linear low, FP8 decided as before); with a
    break-even given, a linear fp8_modules names still stays low (FP8 rides on it) while the others go float32."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    x = torch.randn(16, 32)
    table.BREAK_EVEN["cpu"] = table.BreakEven(10**9, 0)
    try:
        amp = ampfx.convert(model, "bf16", example_inputs=(x,), fp8="tensorwise", fp8_roofline="none")
    finally:
        del table.BREAK_EVEN["cpu"]
    assert {r.rule for r in amp.ampfx_report.records if r.op == "linear"} == {"table"}
    amp = ampfx.convert(model, "bf16", example_inputs=(x,), fp8="tensorwise", fp8_roofline="none",
                        fp8_modules=("2",), gemm_min_flops=10**9)
    rules = {r.module: (r.rule, r.fp8.rule if r.fp8 else None) for r in amp.ampfx_report.records if r.op == "linear"}
    assert rules["2"] == ("table", "fp8:forced") and rules["0"][0] == rules["4"][0] == "cost:small-gemm"


def test_attention_modules_transposed_convolutions_keyword_operands_and_projections_are_counted():
    """nn.MultiheadAttention from its projections and attention; ConvTranspose2d from its input; torch.mm with
    its operands by keyword; an LSTM with proj_size counts its projection matrices too."""
    class Many(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.up = nn.ConvTranspose2d(4, 2, 3)
            self.lstm = nn.LSTM(8, 16, proj_size=4)

        def forward(self, x, img, a, b):
            return self.attn(x, x, x, need_weights=False)[0], self.up(img), torch.mm(input=a, mat2=b), self.lstm(x)[0]

    inputs = (torch.randn(2, 5, 8), torch.randn(1, 4, 6, 6), torch.randn(3, 7), torch.randn(7, 2))
    gm, _ = run(Many(), inputs, **COST)
    got = {n.target: int(gemm_cost.flops(n, gm)) for n in gm.graph.nodes if n.op == "call_module"}
    got["mm"] = int(gemm_cost.flops(node(gm, "mm"), gm))
    tokens = 2 * 5
    assert got == {"attn": 2 * (tokens * 3 * 8 * 8 + tokens * 8 * 8) + 4 * tokens * 5 * 8,
                   "up": 2 * (4 * 6 * 6) * (2 * 3 * 3), "mm": 2 * 3 * 2 * 7,
                   "lstm": 2 * (tokens if torch.backends.mkldnn.is_available() else 5)  # oneDNN: every step
                   * (4 * 16 * 8 + 4 * 16 * 4 + 4 * 16)}


def test_a_weight_used_for_few_rows_stays_float32_and_a_product_of_activations_is_decided_by_its_flops():
    """gemm_min_rows=16: the linear's weight (16x16) is used for 8 rows a call (F / 2W = 4,096 / 512), under 16:
    float32, the reason gives the rows; the batched product has no weight and stays low; gemm_min_rows=0 turns the
    check off, and gemm_min_flops=0 turns the whole rule off whatever the rows."""
    gm, _ = run(Mixed(), INPUTS, gemm_min_flops=1, gemm_min_rows=16, **COST)
    small = rec(gm, "small")
    assert small.rule == "cost:small-gemm" and "used for 8 rows a call, under 16" in small.reason, small.reason
    assert rec(gm, "matmul").rule == "table"
    assert rec(gm, "large").rule == "cost:small-gemm"  # 512x16 weight, also 8 rows
    gm, _ = run(Mixed(), INPUTS, gemm_min_flops=1, gemm_min_rows=0, **COST)
    assert rec(gm, "small").rule == "table"
    gm, _ = run(Mixed(), INPUTS, gemm_min_flops=0, gemm_min_rows=16, **COST)
    assert rec(gm, "small").rule == "table"


def test_a_product_with_a_parameter_counts_its_rows_and_symbolic_weights_are_written_with_their_bound():
    """``addmm(b, x, W)`` with W a parameter (Hugging Face's Conv1D) has a weight: 8 rows, under 16, float32 like
    the same linear; attention's own products are not counted as rows of its module's weights; a weight whose
    size is symbolic is written as its expression."""
    class Conv1D(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(16, 32)), nn.Parameter(torch.zeros(32))

        def forward(self, x):
            return torch.addmm(self.bias, x, self.weight)

    gm, _ = run(Conv1D(), (torch.randn(8, 16),), gemm_min_flops=1, gemm_min_rows=16, **COST)
    assert "used for 8 rows a call" in rec(gm, "addmm").reason
    attn = nn.MultiheadAttention(8, 2, batch_first=True)

    class Attend(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    gm, _ = run(Attend(), (torch.randn(2, 40, 8),), **COST)
    mha = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert gemm_cost.work(mha, gm).rows == 80  # its 2 x 40 tokens, whatever the sequence length
    class Linear(nn.Module):
        def forward(self, x, w):
            return F.linear(x, w)

    amp = ampfx.convert(Linear(), "bf16", example_inputs=(torch.randn(8, 16), torch.randn(32, 16)),
                        dynamic_dims={1: "k"}, gemm_min_flops=1, gemm_min_rows=16)
    d = next(r for r in amp.ampfx_report.records if r.op == "linear")
    assert d.rule == "cost:small-gemm" and "weight elements used for 8 rows" in d.reason and "k" in d.reason, d.reason


def test_a_gemm_kept_by_its_cost_reads_as_cost_and_its_followers_say_so():
    """A linear kept float32 by the cost rule shows the category word ``cost`` in the table (not ``deny``, which
    would read as if linear were on the deny list), and the ops that follow it float32 name the cost decision."""
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    amp = ampfx.convert(model, "bf16", example_inputs=(torch.randn(8, 16),), gemm_min_flops=10**6)
    rows = {r.op: r for r in amp.ampfx_report.compute}
    assert rows["linear"].shown_category == "cost" and rows["gelu"].shown_category == "infer"
    assert "follows a GEMM kept float32 by its cost (cost:small-gemm)" in rows["gelu"].reason, rows["gelu"].reason
    table = amp.ampfx_report.table()
    assert " cost " in table and " deny " not in table
