"""``convert(model, "bf16", fp8=...)``: every GEMM node gets an FP8 decision with a rule and a reason (in the report,
``decisions.jsonl`` and the summary), the rules decide as written, FP8 linears train as the bf16 plan does, and
asking for FP8 is never a silent no-op."""
from __future__ import annotations

import copy
import json
import math
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx.errors import PolicyError
from ampfx.policy import fp8 as vocabulary
from ampfx.report.records import Fp8Rule
from ampfx.runtime.fp8 import linear_fp8
from support.fidelity_models import gpt

EVERY_SIZE = {"fp8": "tensorwise", "fp8_roofline": "none"}


def _gemm_rows(amp):
    return [r for r in amp.ampfx_report.compute if r.op in ampfx.ops.ENTRIES
            and ampfx.ops.ENTRIES[r.op].category is ampfx.ops.Category.ALLOW]


def _fp8_calls(amp):
    return [n for m in amp.modules() if isinstance(getattr(m, "graph", None), torch.fx.Graph)
            for n in m.graph.nodes if n.target is linear_fp8]


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.hidden, self.head = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.head(F.relu(self.hidden(F.relu(self.inp(x)))))


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.mid, self.mid2, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        y = F.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.head(F.relu(self.mid2(F.relu(self.mid(y)))))


FAMILIES = {
    "mlp": (Mlp, lambda: (torch.randn(16, 32),), "fx"),
    "gpt": (lambda: gpt()[0], lambda: gpt()[1], "auto"),
    "cnn": (Cnn, lambda: (torch.randn(2, 3, 8, 8),), "fx"),
    "mlp_export": (Mlp, lambda: (torch.randn(16, 32),), "export"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_gemm_node_has_an_fp8_decision_with_a_rule_and_reason_in_the_log(family, tmp_path):
    """On an MLP, a GPT (linears and products of activations, blocks converted on their own), a CNN (a convolution)
    and an exported MLP: each GEMM node's record holds an FP8 decision whose rule is an Fp8Rule and whose reason is
    a sentence; ``decisions.jsonl`` holds it under ``fp8``; the FP8 nodes are those that call the FP8 linear."""
    build, inputs, tracer = FAMILIES[family]
    amp = ampfx.convert(build(), "bf16", example_inputs=inputs(), tracer=tracer, log_path=tmp_path, **EVERY_SIZE)
    rows = _gemm_rows(amp)
    assert rows and all(r.fp8 is not None and isinstance(r.fp8.rule, Fp8Rule) and len(r.fp8.reason) > 10 for r in rows)
    assert all(r.fp8 is None for r in amp.ampfx_report.compute if r not in rows)
    on = [r for r in rows if r.fp8.output]
    assert len(on) == len(_fp8_calls(amp)) >= 1
    assert all(r.op == "linear" and r.fp8.rule in (Fp8Rule.FP8, Fp8Rule.FORCED) for r in on)
    assert all(r.fp8.rule is Fp8Rule.OP for r in rows if r.op != "linear")
    lines = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    logged = {(d["module"], d["node"]): d["fp8"] for d in lines if d.get("fp8")}
    assert {(r.module, r.node) for r in rows} == set(logged)
    assert all(set(v) >= {"recipe", "rule", "reason", "output", "input_grad", "weight_grad", "flops"}
               for v in logged.values())
    assert "FP8 (tensorwise)" in (tmp_path / "summary.txt").read_text()


def test_the_rules_decide_in_their_order():
    """First and last nn.Linear: position; the middle one: FP8 with fp8_roofline='none', cost under the default
    H100 roofline at these sizes, FP8 again when forced by module; a linear whose sizes are not multiples of 16:
    shape; a module skipped: fp8:module; a linear kept float32 by fp32_modules: not-low."""
    x = (torch.randn(16, 32),)
    rules = lambda amp: {r.module: r.fp8.rule for r in _gemm_rows(amp)}  # noqa: E731
    assert rules(ampfx.convert(Mlp(), example_inputs=x, **EVERY_SIZE)) == {
        "inp": Fp8Rule.POSITION, "hidden": Fp8Rule.FP8, "head": Fp8Rule.POSITION}
    with pytest.warns(UserWarning, match="put no GEMM in FP8"):
        costly = ampfx.convert(Mlp(), example_inputs=x, fp8="tensorwise")
    assert rules(costly)["hidden"] is Fp8Rule.COST and "quantising the operands costs more" in \
        _gemm_rows(costly)[1].fp8.reason
    assert rules(ampfx.convert(Mlp(), example_inputs=x, fp8="tensorwise", fp8_modules=("hidden",)))["hidden"] \
        is Fp8Rule.FORCED
    assert rules(ampfx.convert(Mlp(), example_inputs=x, fp8="tensorwise", fp8_modules=("hidden", "head")))["head"] \
        is Fp8Rule.FORCED
    with pytest.warns(UserWarning):
        assert rules(ampfx.convert(Mlp(), example_inputs=x, fp8_skip_modules="hidden", **EVERY_SIZE))["hidden"] \
            is Fp8Rule.SKIPPED
    with pytest.warns(UserWarning):
        assert rules(ampfx.convert(Mlp(), example_inputs=x, fp32_modules="hidden", **EVERY_SIZE))["hidden"] \
            is Fp8Rule.NOT_LOW
    odd = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 24), nn.Linear(24, 16))
    with pytest.warns(UserWarning):
        assert rules(ampfx.convert(odd, example_inputs=x, **EVERY_SIZE))["1"] is Fp8Rule.SHAPE


def test_the_roofline_decides_by_the_gemms_sizes():
    """With a device whose threshold M*N/(M+N) sits between two layers' sizes, the larger runs in FP8, the smaller
    stays low; the reasons name the sizes and the device."""
    tiny = vocabulary.Roofline("mine", bf16_tflops=1.0, fp8_tflops=2.0, bandwidth_tbs=1.0, quantize_bytes=24.0)
    assert 20 < tiny.threshold < 30
    m = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 64), nn.Linear(64, 16), nn.Linear(16, 32), nn.Linear(32, 16))
    amp = ampfx.convert(m, example_inputs=(torch.randn(64, 32),), fp8="tensorwise", fp8_roofline=tiny)
    by = {r.module: r.fp8 for r in _gemm_rows(amp)}
    assert by["1"].rule is Fp8Rule.FP8 and "M=64, N=64" in by["1"].reason and "mine" in by["1"].reason
    assert by["2"].rule is Fp8Rule.COST and "M=64, N=16" in by["2"].reason


class Router(nn.Module):
    """A mixture of experts' gate: a linear whose scores pick the top two experts."""

    def __init__(self):
        super().__init__()
        self.pre, self.gate, self.up, self.post = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 32), \
            nn.Linear(32, 32)

    def forward(self, x):
        h = self.pre(x)
        weights, chosen = torch.topk(self.gate(h).softmax(-1), 2, dim=-1)
        return self.post(self.up(h) * weights.sum(-1, keepdim=True)), chosen


def test_a_router_stays_low():
    amp = ampfx.convert(Router(), example_inputs=(torch.randn(16, 32),), **EVERY_SIZE)
    by = {r.module: r.fp8 for r in _gemm_rows(amp)}
    assert by["gate"].rule is Fp8Rule.ROUTER and "topk" in by["gate"].reason
    assert by["up"].rule is Fp8Rule.FP8


def test_fp8_from_the_environment(monkeypatch):
    """AMPFX_FP8, AMPFX_FP8_ROOFLINE and AMPFX_FP8_SKIP_MODULES set what the arguments set; the report's policy
    record says so."""
    monkeypatch.setenv("AMPFX_FP8", "rowwise")
    monkeypatch.setenv("AMPFX_FP8_ROOFLINE", "none")
    amp = ampfx.convert(Mlp(), example_inputs=(torch.randn(16, 32),))
    assert {r.module: r.fp8.rule for r in _gemm_rows(amp)}["hidden"] is Fp8Rule.FP8
    assert amp.ampfx_report.policy["fp8"] == "rowwise" and amp.ampfx_report.policy["fp8_roofline"] == "none"
    monkeypatch.setenv("AMPFX_FP8_SKIP_MODULES", "hidden")
    with pytest.warns(UserWarning):
        amp = ampfx.convert(Mlp(), example_inputs=(torch.randn(16, 32),))
    assert {r.module: r.fp8.rule for r in _gemm_rows(amp)}["hidden"] is Fp8Rule.SKIPPED


@pytest.mark.parametrize("options, message", [
    ({"fp8": "tensorwse"}, r"fp8='tensorwse' is not an FP8 recipe.*Did you mean 'tensorwise'"),
    ({"fp8": "tensorwise", "fp8_roofline": "h300"}, r"fp8_roofline='h300'.*Did you mean"),
    ({"fp8_modules": ("hidden",)}, r"fp8_modules=.*without fp8"),
    ({"fp8_roofline": "none"}, r"fp8_roofline='none' without fp8"),
    ({"fp8": "tensorwise", "fp8_modules": ("nothere",)}, r"fp8_modules / AMPFX_FP8_MODULES names 'nothere'"),
    ({"fp8": "tensorwise", "fp8_modules": "hidden", "fp8_skip_modules": "hidden"}, r"both fp8_modules and"),
    ({"fp8_error_threshold": 0.2}, r"fp8_error_threshold=0.2 without fp8"),
    ({"fp8": "tensorwise", "fp8_error_threshold": -1}, r"fp8_error_threshold=-1: use a relative error >= 0"),
    ({"fp8": "tensorwise", "fp8_error_threshold": "high"}, r"fp8_error_threshold='high'"),
])
def test_bad_fp8_options_are_errors_naming_them(options, message):
    with pytest.raises(PolicyError, match=message):
        ampfx.convert(Mlp(), **options)


def test_a_misspelt_recipe_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("AMPFX_FP8", "rowwize")
    with pytest.raises(PolicyError, match=r"AMPFX_FP8='rowwize': use tensorwise, rowwise.*Did you mean 'rowwise'"):
        ampfx.convert(Mlp())


def test_a_torch_without_float8_dtypes_is_an_error(monkeypatch):
    monkeypatch.setattr(vocabulary, "HAS_FP8", False)
    with pytest.raises(PolicyError, match=r"has no float8 dtypes.*torch >= 2.1"):
        ampfx.convert(Mlp(), fp8="tensorwise")


def test_no_gemm_in_fp8_is_said_in_a_warning_and_the_summary():
    with pytest.warns(UserWarning, match=r"fp8='tensorwise' put no GEMM in FP8: 3 GEMM nodes .*fp8:cost 1"):
        amp = ampfx.convert(Mlp(), example_inputs=(torch.randn(16, 32),), fp8="tensorwise")
    summary = amp.ampfx_report.summary()
    assert "FP8 (tensorwise): 0/3 GEMM nodes" in summary and "put no GEMM in FP8" in summary


def test_without_fp8_nothing_changes():
    amp = ampfx.convert(Mlp(), example_inputs=(torch.randn(16, 32),))
    assert all(r.fp8 is None for r in amp.ampfx_report.records) and not _fp8_calls(amp)
    assert "FP8" not in amp.ampfx_report.summary()


def test_the_summary_gives_the_share_of_gemm_flops_in_fp8():
    """The GPT (d=32, 16 tokens, batch 4): qkv, proj, fc and out of both blocks in FP8 (its first linear, the
    first block's qkv, and the head stay low by position), the attention products low by op."""
    model, inputs, _ = gpt()
    amp = ampfx.convert(model, example_inputs=inputs, **EVERY_SIZE)
    rows = _gemm_rows(amp)
    on = sum(r.fp8.flops for r in rows if r.fp8.output)
    total = sum(r.fp8.flops for r in rows)
    assert f"{on:,} of {total:,} GEMM FLOPs ({on / total:.0%})" in amp.ampfx_report.summary()
    assert {r.module for r in rows if r.fp8.rule is Fp8Rule.POSITION} == {"blocks.0.attn.qkv", "head"}
    assert len([r for r in rows if r.fp8.output]) == 7


def _train(model, inputs_of, steps, **options):
    amp = ampfx.convert(model, "bf16", example_inputs=(inputs_of(0)[:, :-1],), **options)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        tokens = inputs_of(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            logits = amp(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 64), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return amp, losses


def _tokens(step):
    """A learnable next-token pattern: each row counts up from a random start, modulo 8, in one of 8 bands."""
    g = torch.Generator().manual_seed(step)
    start, band = torch.randint(0, 8, (8, 1), generator=g), torch.randint(0, 8, (8, 1), generator=g)
    return band * 8 + (start + torch.arange(17)) % 8


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_small_gpt_trained_in_fp8_ends_within_one_percent_of_its_bf16_loss(recipe):
    """300 AdamW steps of the GPT: the FP8 plan (7 of 13 GEMM nodes, three GEMMs each) and the bf16 plan end
    within 1% (mean of the last 20 losses), having learnt (well below the first loss); the FP8 run differs from
    the bf16 one (it is not a no-op)."""
    model = gpt()[0]
    _, bf16 = _train(copy.deepcopy(model), _tokens, 300)
    amp, fp8 = _train(copy.deepcopy(model), _tokens, 300, fp8=recipe, fp8_roofline="none")
    assert len(_fp8_calls(amp)) == 7
    end_bf16, end_fp8 = sum(bf16[-20:]) / 20, sum(fp8[-20:]) / 20
    assert end_bf16 < 0.7 * bf16[0]
    assert abs(end_fp8 / end_bf16 - 1) < 0.01, (end_bf16, end_fp8)
    assert fp8 != bf16


def test_an_fp8_module_copies_pickles_and_converts_again_for_eval():
    """deepcopy and pickle keep the FP8 calls and their results; eval mode converts the other mode with the same
    FP8 decisions; the state dict is the model's float32 parameters."""
    model, x = Mlp(), torch.randn(16, 32)
    amp = ampfx.convert(model, example_inputs=(x,), **EVERY_SIZE)
    want = amp(x)
    for other in (copy.deepcopy(amp), pickle.loads(pickle.dumps(amp))):
        torch.testing.assert_close(other(x), want)
        assert len(_fp8_calls(other)) == 1
    amp.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no GEMM in FP8" here: the eval graph has its FP8 linear
        out = amp(x)
    assert len(_fp8_calls(amp)) >= 1 and (out - model(x)).abs().max() < 0.1
    assert all(t.dtype == torch.float32 for t in amp.state_dict().values())


def test_an_fp8_module_compiles_and_trains():
    """torch.compile of a converted module with an FP8 linear (aot_eager: the graph dynamo makes of it) gives the
    eager result and gradients."""
    model, x = Mlp(), torch.randn(16, 32)
    amp = ampfx.convert(model, example_inputs=(x,), **EVERY_SIZE)
    want = amp(x)
    want.sum().backward()
    grad = model.hidden.weight.grad.clone()
    model.zero_grad()
    got = torch.compile(amp, backend="aot_eager")(x)
    got.sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(model.hidden.weight.grad, grad)


def test_the_compile_backend_decides_fp8_in_each_graph_it_converts():
    """``torch.compile(model, backend=ampfx.backend(..., fp8=...))``: the graphs dynamo captures hold parameters,
    not the model's modules, so no position is known (a graph break would make a graph's own ends wrong): every
    linear runs in FP8 where it pays; the result is close to the float32 model's. FP8 module lists name modules,
    which the backend cannot see: refused up front, as fp32_modules is."""
    model, x = Mlp(), torch.randn(16, 32)
    backend = ampfx.backend("bf16", inner="aot_eager", **EVERY_SIZE)
    out = torch.compile(model, backend=backend)(x)
    rules = [d.fp8.rule for g in backend.graphs for d in g.report.records if d.fp8 is not None]
    assert rules == [Fp8Rule.FP8] * 3
    assert ((out - model(x)).norm() / model(x).norm()).item() < 0.1  # three FP8 layers, about 4% each
    with pytest.raises(ampfx.errors.ArgumentError, match=r"fp8_skip_modules / AMPFX_FP8_SKIP_MODULES.*names modules"):
        ampfx.backend("bf16", fp8="tensorwise", fp8_skip_modules=("inp",))


def test_a_recipe_of_ones_own_named_as_a_preset_is_refused():
    """A recipe named like a preset but differing from it would run as the preset (graphs name presets by name)."""
    mine = vocabulary.Recipe("tensorwise", rowwise=True)
    with pytest.raises(PolicyError, match=r"differs from the preset of that name"):
        ampfx.convert(Mlp(), fp8=mine)
    with pytest.raises(PolicyError, match=r"rowwise='yes': use True or False"):
        vocabulary.Recipe("mine", rowwise="yes")
    assert vocabulary.recipe(vocabulary.Recipe("tensorwise", rowwise=False)) is not None  # equal to the preset


def test_fp8_options_are_checked_after_the_environment_and_policy_file(monkeypatch, tmp_path):
    """fp8 from AMPFX_FP8 or a policy file with fp8_roofline / fp8_modules in code converts; AMPFX_FP8=off turns
    FP8 off and drops the code's FP8 options (a switch without a code edit); any roofline, the default's name too,
    without fp8 anywhere is an error."""
    x = (torch.randn(16, 32),)
    monkeypatch.setenv("AMPFX_FP8", "tensorwise")
    amp = ampfx.convert(Mlp(), example_inputs=x, fp8_roofline="none")
    assert _gemm_rows(amp)[1].fp8.rule is Fp8Rule.FP8
    monkeypatch.setenv("AMPFX_FP8", "off")
    amp = ampfx.convert(Mlp(), example_inputs=x, fp8="tensorwise", fp8_modules=("hidden",))
    assert all(r.fp8 is None for r in amp.ampfx_report.records) and not _fp8_calls(amp)
    monkeypatch.delenv("AMPFX_FP8")
    path = ampfx.Policy(fp8="rowwise").save(tmp_path / "p.json")
    monkeypatch.setenv("AMPFX_POLICY_FILE", str(path))
    amp = ampfx.convert(Mlp(), "bf16", example_inputs=x, fp8_roofline="none")
    assert _gemm_rows(amp)[1].fp8.rule is Fp8Rule.FP8 and _gemm_rows(amp)[1].fp8.recipe == "rowwise"
    monkeypatch.delenv("AMPFX_POLICY_FILE")
    with pytest.raises(PolicyError, match=r"fp8_roofline='h100' without fp8"):
        ampfx.convert(Mlp(), fp8_roofline="h100")


class OwnLinear(nn.Module):
    """A linear layer of the model's own (F.linear on its parameter), no nn.Linear."""

    def __init__(self, k, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, k) * 0.1)

    def forward(self, x):
        return F.linear(x, self.w)


class OwnBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = OwnLinear(32, 64), OwnLinear(64, 32)

    def forward(self, x):
        return x + self.out(F.relu(self.fc(x)))


def test_a_model_without_nn_linear_in_kept_blocks_runs_its_linears_in_fp8():
    """Repeated blocks converted each on its own, linears of the model's own: no position is known, none is taken
    for a block's ends; every linear runs in FP8."""
    model = nn.Sequential(OwnBlock(), OwnBlock(), OwnBlock())
    amp = ampfx.convert(model, example_inputs=(torch.randn(16, 32),), keep_modules=("0", "1", "2"), **EVERY_SIZE)
    rows = _gemm_rows(amp)
    assert len(rows) == 6 and all(r.fp8.rule is Fp8Rule.FP8 for r in rows) and len(_fp8_calls(amp)) == 6


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.head = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        logits = self.head(F.relu(self.c(F.relu(self.b(F.relu(self.a(x)))))))
        return logits, logits.argmax(-1)


def test_a_classifiers_accuracy_argmax_makes_no_router():
    """The arg-max of the logits is the head's choice: the layer before the head reaches it only through the
    head (another GEMM), so it is no router."""
    amp = ampfx.convert(Classifier(), example_inputs=(torch.randn(16, 32),), **EVERY_SIZE)
    assert {r.module: r.fp8.rule for r in _gemm_rows(amp)}["c"] is Fp8Rule.FP8


def test_a_weight_two_fp8_linears_read_is_quantised_from_its_float32_master_by_both():
    """One nn.Linear called twice: both calls quantise the float32 weight itself (no bfloat16 copy between)."""
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.mid, self.head = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16)

        def forward(self, x):
            h = self.inp(x)
            return self.head(self.mid(F.relu(self.mid(h))))

    amp = ampfx.convert(Twice(), example_inputs=(torch.randn(16, 32),), **EVERY_SIZE)
    calls = _fp8_calls(amp)
    assert len(calls) == 2 and all(c.args[1].op == "get_attr" for c in calls)
    assert "mid_weight_bf16" not in amp.code


def test_the_flops_share_counts_the_matrix_products_it_knows():
    """A convolution's FLOPs are not counted (no matrix layout): the share says of which nodes it is."""
    amp = ampfx.convert(Cnn(), example_inputs=(torch.randn(2, 3, 8, 8),), **EVERY_SIZE)
    assert "of the 3 nodes whose FLOPs are known (matrix products)" in amp.ampfx_report.summary()
    assert [r.fp8.flops for r in _gemm_rows(amp) if r.op != "linear"] == [None]


def test_the_page_shows_each_gemms_fp8_decision():
    """The HTML page: the summary's FP8 line, an fp8 column in the decisions table (which GEMMs, recipe, rule,
    reason), and the node panel's field."""
    amp = ampfx.convert(Mlp(), example_inputs=(torch.randn(16, 32),), **EVERY_SIZE)
    page = amp.ampfx_report.html()
    assert "FP8 (tensorwise): 1/3 GEMM nodes" in page
    assert "fp8 (output, input gradient, weight gradient; tensorwise): K=64, N=64" in page
    assert "fp8:position (none in FP8; tensorwise): inp is the model&#x27;s first linear layer" in page \
        or "fp8:position (none in FP8; tensorwise): inp is the model's first linear layer" in page
    assert '["fp8", n.fp8 ?' in page


class Spiky(nn.Module):
    """One feature of ``c``'s input a million times the others, which ``c`` does not read: tensorwise scaling sizes
    the scale by that feature, and ``c``'s other inputs quantise to FP8's subnormals or to zero."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 64)
        with torch.no_grad():
            self.c.weight[:, 0] = 0

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return self.d(self.c(h * torch.cat([torch.full((1,), 1e6), torch.ones(255)])))


def test_calibration_measures_each_linears_fp8_error_and_amax_and_keeps_a_sensitive_one_low(tmp_path, monkeypatch):
    """Rule: with calibrate= batches, every linear's FP8 decision carries its operands' amax and its FP8 output error
    against the low dtype, measured on them (in the record, decisions.jsonl, the summary and the page); one over
    fp8_error_threshold stays low (fp8:sensitive); the threshold off (0, or AMPFX_FP8_ERROR_THRESHOLD=off) keeps
    the measurement and drops the rule."""
    torch.manual_seed(0)
    model = Spiky()
    batches = [torch.randn(64, 64) for _ in range(3)]
    options = dict(example_inputs=(batches[0],), calibrate=batches, **EVERY_SIZE)
    amp = ampfx.convert(model, "bf16", log_path=tmp_path, **options)
    rows = {r.module: r.fp8 for r in _gemm_rows(amp)}
    assert rows["c"].rule is Fp8Rule.SENSITIVE and not rows["c"].output and rows["c"].error > 0.5
    assert "over fp8_error_threshold 0.1" in rows["c"].reason and "quantise to zero" in rows["c"].reason
    assert rows["b"].rule is Fp8Rule.FP8 and rows["b"].output and 0 < rows["b"].error < 0.1
    for name in "abcd":
        seen = rows[name]
        assert seen.amax_weight == pytest.approx(float(getattr(model, name).weight.detach().abs().max()))
        assert seen.amax_input > 0 and seen.amax_grad > 0 and 0 <= seen.underflow <= 1
    assert rows["c"].amax_input > 1e5 > rows["b"].amax_input
    assert rows["c"].underflow > rows["b"].underflow
    assert [n.args[0].name for n in _fp8_calls(amp)] != []  # b still runs in FP8
    logged = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert {d["module"]: d["fp8"]["rule"] for d in logged if d.get("fp8")}["c"] == "fp8:sensitive"
    assert all(d["fp8"]["amax_input"] > 0 for d in logged if d.get("fp8"))
    line = amp.ampfx_report.fp8_lines()[1]
    assert "FP8 in calibration (4 of 4 GEMM nodes)" in line and "largest linear_2" in line
    logged_c = next(d["fp8"] for d in logged if d.get("fp8") and d["module"] == "c")
    assert "in calibration: error" in ampfx.report.html.fp8_text(logged_c)

    off = ampfx.convert(model, "bf16", fp8_error_threshold=0, **options)
    assert {r.module: r.fp8.rule for r in _gemm_rows(off)}["c"] is Fp8Rule.FP8
    assert {r.module: r.fp8.error for r in _gemm_rows(off)}["c"] > 0.5
    monkeypatch.setenv("AMPFX_FP8_ERROR_THRESHOLD", "off")
    assert {r.module: r.fp8.rule for r in _gemm_rows(ampfx.convert(model, "bf16", **options))}["c"] is Fp8Rule.FP8
    monkeypatch.setenv("AMPFX_FP8_ERROR_THRESHOLD", "0.99")
    assert {r.module: r.fp8.rule for r in _gemm_rows(ampfx.convert(model, "bf16", **options))}["c"] is Fp8Rule.FP8


def test_without_calibration_an_fp8_decision_has_no_amax():
    amp = ampfx.convert(Mlp(), example_inputs=(torch.randn(16, 32),), **EVERY_SIZE)
    assert all(r.fp8.amax_input is None and r.fp8.error is None for r in _gemm_rows(amp))
    assert len(amp.ampfx_report.fp8_lines()) == 1


def test_delayed_scaling_keeps_an_amax_history_per_fp8_linear_that_copies_pickles_and_compiles():
    """Rule: a recipe with amax_history gives each FP8 linear an AmaxHistory on the graph module, read by its call;
    training steps (eager and compiled) record into it; a deep copy or a pickle carries its values and then records
    apart; the model trains as under current scaling."""
    from ampfx.policy.fp8 import Recipe
    from ampfx.runtime.fp8 import AmaxHistory
    torch.manual_seed(0)
    delayed = Recipe("delayed8", rowwise=False, amax_history=8)
    model, x = Mlp(), torch.randn(16, 32)
    amp = ampfx.convert(model, example_inputs=(x,), fp8=delayed, fp8_roofline="none")
    calls = _fp8_calls(amp)
    assert len(calls) == 1 and calls[0].args[3][-1] == 8
    history = getattr(amp, calls[0].args[4].target)
    assert isinstance(history, AmaxHistory) and not history.values.any()  # converting recorded nothing
    amp(x).float().square().mean().backward()
    recorded = lambda h: int((h.values != 0).sum())  # noqa: E731
    assert recorded(history) == 2  # input and output gradient
    for other in (copy.deepcopy(amp), pickle.loads(pickle.dumps(amp))):
        theirs = getattr(other, calls[0].args[4].target)
        assert theirs is not history and torch.equal(theirs.values, history.values)
        other(x).float().square().mean().backward()
        assert recorded(theirs) == 4 and recorded(history) == 2
    torch.compile(amp, backend="aot_eager")(x).float().square().mean().backward()
    assert recorded(history) == 4

    def train(fp8):
        torch.manual_seed(1)
        net = Mlp()
        run = ampfx.convert(net, example_inputs=(x,), fp8=fp8, fp8_roofline="none")
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        target = torch.randn(16, 16)
        for _ in range(30):
            opt.zero_grad()
            loss = F.mse_loss(run(x).float(), target)
            loss.backward()
            opt.step()
        return loss.item()

    assert train(delayed) == pytest.approx(train("tensorwise"), rel=0.05)


def test_calibration_under_delayed_scaling_counts_the_input_values_that_saturate():
    """Rule: with a delayed recipe, calibration batches that grow give each FP8 linear the share of a batch's input
    past the amax of the batches before it (saturated); under current scaling none saturate."""
    from ampfx.policy.fp8 import Recipe
    torch.manual_seed(0)
    batches = [torch.randn(16, 32) * scale for scale in (1.0, 1.0, 3.0)]
    options = dict(example_inputs=(batches[0],), calibrate=batches, fp8_roofline="none")
    delayed = ampfx.convert(Mlp(), fp8=Recipe("delayed4", rowwise=False, amax_history=4), **options)
    hidden = {r.module: r.fp8 for r in _gemm_rows(delayed)}["hidden"]
    assert 0 < hidden.saturated < 1
    assert "of an input past its history (scaled by its own amax)" in delayed.ampfx_report.fp8_lines()[1]
    current = ampfx.convert(Mlp(), **options, fp8="tensorwise")
    assert {r.module: r.fp8 for r in _gemm_rows(current)}["hidden"].saturated == 0


def test_delayed_scaling_compiled_first_checkpointed_and_evaluated_records_as_it_should():
    """Rule: compiled before any eager call, the history records each step; under activation checkpointing the
    recompute scales as its forward did (gradients and history equal the run without checkpointing); calls without
    gradients record nothing; the compile backend refuses a delayed recipe, naming what to do."""
    from torch.utils.checkpoint import checkpoint

    from ampfx.errors import ArgumentError
    from ampfx.policy.fp8 import Recipe
    delayed = Recipe("delayed4", rowwise=False, amax_history=4)
    options = dict(fp8=delayed, fp8_roofline="none", keep_modules="none")
    x = torch.randn(16, 32)
    history = lambda amp: next(v for k, v in vars(amp).items() if k.startswith("_ampfx_fp8_amax"))  # noqa: E731

    torch.manual_seed(0)
    amp = ampfx.convert(Mlp(), example_inputs=(x,), **options)
    compiled = torch.compile(amp, backend="aot_eager")
    for i in range(3):
        compiled(x * (i + 1)).float().square().mean().backward()
    assert int((history(amp).values != 0).sum()) == 6 and not history(amp).values.requires_grad

    torch.manual_seed(0)
    plain, again = Mlp(), Mlp()
    again.load_state_dict(plain.state_dict())
    a, b = ampfx.convert(plain, example_inputs=(x,), **options), ampfx.convert(again, example_inputs=(x,), **options)
    for i in range(3):
        a(x * (i + 1)).float().square().mean().backward()
        checkpoint(b, x * (i + 1), use_reentrant=False).float().square().mean().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), again.parameters()))
    assert torch.equal(history(a).values, history(b).values)
    seen = history(a).values.clone()
    with torch.no_grad():
        a(x * 100)
    assert torch.equal(history(a).values, seen)

    with pytest.raises(ArgumentError, match="delayed scaling.*convert first and compile"):
        ampfx.backend("bf16", fp8=delayed)


def test_calibration_reads_a_bias_given_by_keyword():
    """A linear called as F.linear(x, w, bias=b) is measured with its bias (a large bias measured without it would
    look like a large FP8 error)."""
    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16)
            with torch.no_grad():
                self.b.bias.fill_(50.0)

        def forward(self, x):
            return self.c(F.linear(torch.relu(self.a(x)), self.b.weight, bias=self.b.bias))

    torch.manual_seed(0)
    batches = [torch.randn(16, 32) for _ in range(2)]
    amp = ampfx.convert(Biased(), example_inputs=(batches[0],), calibrate=batches, **EVERY_SIZE)
    linear = next(r.fp8 for r in _gemm_rows(amp) if r.fp8 is not None and r.fp8.rule is Fp8Rule.FP8)
    assert linear.error < 0.01


class Deep(nn.Module):
    """Six linears: the four in the middle run in FP8 (the first and last stay in the low dtype)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


def _relative(y, want):
    return float((y.detach().float() - want.detach()).norm() / want.detach().norm())


def _delayed_deep(seed=0):
    from ampfx.policy.fp8 import Recipe
    torch.manual_seed(seed)
    model = Deep()
    options = dict(fp8=Recipe("delayed8", rowwise=False, amax_history=8), fp8_roofline="none", keep_modules="none")
    amp = ampfx.convert(model, "bf16", example_inputs=(torch.randn(16, 32),), **options)
    assert len(_fp8_calls(amp)) == 4
    return model, amp, options


def _steps(amp, model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x in batches:
        opt.zero_grad()
        amp(x).float().square().mean().backward()
        opt.step()


def test_delayed_scaling_after_load_state_dict_of_larger_weights_matches_a_fresh_conversion():
    """Rule: weights written after training steps (load_state_dict of a checkpoint whose weights are larger) are
    scaled by their own values at the next call, and inputs that grew past the history are scaled by their own
    amax: evaluation under no_grad is as close to float32 as a fresh conversion of the loaded weights."""
    model, amp, options = _delayed_deep()
    _steps(amp, model, [torch.randn(16, 32) for _ in range(3)])
    checkpoint = {k: v * 8 for k, v in model.state_dict().items()}
    amp.load_state_dict(checkpoint)
    amp.eval()
    reference, fresh_model = Deep(), Deep()
    reference.load_state_dict(checkpoint)
    fresh_model.load_state_dict(checkpoint)
    fresh = ampfx.convert(fresh_model.eval(), "bf16", example_inputs=(torch.randn(16, 32),), **options)
    x = torch.randn(16, 32)
    with torch.no_grad():
        want = reference.eval()(x)
        ours, theirs = _relative(amp(x), want), _relative(fresh(x), want)
        again = _relative(amp(x), want)
    assert ours < 0.1 and ours <= theirs * 1.5 + 0.01 and again == ours


def test_delayed_scaling_after_an_in_place_reinitialisation_matches_a_fresh_conversion():
    """Rule: a layer re-initialised in place under no_grad (nn.init) after training steps is scaled by its new
    values at the next training call: its output is as close to float32 as a fresh conversion's."""
    model, amp, options = _delayed_deep()
    _steps(amp, model, [torch.randn(16, 32) for _ in range(3)])
    with torch.no_grad():
        nn.init.normal_(model.layers[2].weight, std=1.0)  # ten times its initial spread
    reference = copy.deepcopy(model)
    fresh_model = copy.deepcopy(model)
    fresh = ampfx.convert(fresh_model, "bf16", example_inputs=(torch.randn(16, 32),), **options)
    x = torch.randn(16, 32)
    want = reference(x)
    ours, theirs = _relative(amp(x), want), _relative(fresh(x), want)
    assert ours < 0.1 and ours <= theirs * 1.5 + 0.01


def test_delayed_scaling_under_checkpointing_with_two_forwards_before_one_backward():
    """Rule: with activation checkpointing, two forwards (two views of a batch) before one backward give the
    gradients and history of the same steps without checkpointing: each recompute scales as its own forward did."""
    from torch.utils.checkpoint import checkpoint
    plain_model, plain, _ = _delayed_deep()
    ckpt_model, ckpt, _ = _delayed_deep()
    history = lambda amp: [v.values for k, v in sorted(vars(amp).items()) if k.startswith("_ampfx_fp8_amax")]  # noqa: E731
    torch.manual_seed(3)
    for step in range(3):
        a, b = torch.randn(16, 32) * (step + 1), torch.randn(16, 32) * (3 - step)
        (plain(a).float().square().mean() + plain(b).float().square().mean()).backward()
        (checkpoint(ckpt, a, use_reentrant=False).float().square().mean()
         + checkpoint(ckpt, b, use_reentrant=False).float().square().mean()).backward()
        for p, q in zip(plain_model.parameters(), ckpt_model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
    assert all(torch.equal(h, k) for h, k in zip(history(plain), history(ckpt)))


def test_delayed_scaling_shows_an_overflow_and_the_bad_batch_does_not_poison_the_history():
    """Rule: a corrupt batch (a finite row of 1e25) gives a non-finite loss, as float32 does, where saturation would
    give a finite one; its amax does not enter the history (its gradients are not finite), so the clean steps after
    it equal those of a run that never saw it."""
    torch.manual_seed(4)
    batches = [torch.randn(16, 32) for _ in range(8)]
    bad = batches[3].clone()
    bad[0] = 1e25
    reference = Deep()
    losses = {}
    for name, with_bad in (("clean", False), ("bad", True)):
        model, amp, _ = _delayed_deep(seed=5)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        seen = []
        for i, x in enumerate(batches):
            if with_bad and i == 4:
                reference.load_state_dict(model.state_dict())
                assert not torch.isfinite(reference(bad).float().square().mean())  # float32: not finite
                opt.zero_grad()
                loss = amp(bad).float().square().mean()
                assert not torch.isfinite(loss)
                loss.backward()  # as with GradScaler: the backward runs, the step is skipped
                assert not all(torch.isfinite(p.grad).all() for p in model.parameters())
            opt.zero_grad()
            loss = amp(x).float().square().mean()
            loss.backward()
            opt.step()
            seen.append(loss.item())
        losses[name] = seen
    assert all(math.isfinite(v) for v in losses["bad"])
    assert losses["bad"] == losses["clean"]
