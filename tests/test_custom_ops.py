"""The user's own torch ops (torch.library): every way of naming one, in Policy lists and AMPFX_* variables,
matches the graph's nodes under tracer="fx" and tracer="export"; unknown names are errors with a close
match; ampfx.register_op gives a library's op a default rule that a Policy or the environment overrides."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx import Category, PolicyError, ops
from ampfx.errors import OpRegistrationError
from ampfx.policy import Policy, from_env
from ampfx.ui import cli
from conftest import rel

if not hasattr(torch.library, "custom_op"):  # torch < 2.4 (the DGL lane's 2.2)
    pytest.skip("torch.library.custom_op needs torch >= 2.4", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("one_thread")


@torch.library.custom_op("ampfxt::scale2", mutates_args=())
def scale2(x: torch.Tensor) -> torch.Tensor:
    return x * 2


scale2.register_fake(lambda x: torch.empty_like(x))
scale2.register_autograd(lambda ctx, g: g * 2)

SEEN: list[tuple[torch.dtype, ...]] = []  # dtypes the ops below received, newest last
_LIB = torch.library.Library("ampfxt2", "DEF")  # the older API: define + impl, two overloads
_LIB.define("triple(Tensor x) -> Tensor")
_LIB.define("triple.scaled(Tensor x, float s) -> Tensor")
_LIB.define("mix(Tensor x, Tensor w) -> Tensor")
for _name, _fn in (("triple", lambda x: x * 3), ("triple.scaled", lambda x, s: x * 3 * s),
                   ("mix", lambda x, w: (SEEN.append((x.dtype, w.dtype)), (x.float() * w.float()).to(x.dtype))[1])):
    _LIB.impl(_name, _fn, "CompositeExplicitAutograd")
    _LIB.impl(_name, lambda x, *a: torch.empty_like(x), "Meta")
for _name, _grad in (("triple", lambda ctx, g: g * 3), ("mix", lambda ctx, g: (g * ctx.w, g * ctx.x))):
    torch.library.register_autograd(f"ampfxt2::{_name}", _grad, setup_context=lambda ctx, inputs, output: (
        setattr(ctx, "x", inputs[0]), setattr(ctx, "w", inputs[-1])))
torch.library.register_autograd("ampfxt2::triple.scaled", lambda ctx, g: (g * 3 * ctx.s, None),
                                setup_context=lambda ctx, inputs, output: setattr(ctx, "s", inputs[1]))


class Scaled(nn.Module):
    """linear -> the custom op (called as a CustomOpDef, a packet or an overload) -> linear."""

    def __init__(self, call=scale2):
        super().__init__()
        self.a, self.b, self.call = nn.Linear(8, 8), nn.Linear(8, 8), call

    def forward(self, x):
        return self.b(self.call(self.a(x)))


class Overloads(nn.Module):
    """Both overloads of ampfxt2::triple, called by their overload objects (or, with ``packet``, by the packet)."""

    def __init__(self, packet=False):
        super().__init__()
        self.a, self.packet = nn.Linear(8, 8), packet

    def forward(self, x):
        op = torch.ops.ampfxt2.triple
        y = op(self.a(x)) if self.packet else op.default(self.a(x))
        return self.a(op(y, 0.5) if self.packet else op.scaled(y, 0.5))


X = torch.randn(4, 8)


@pytest.fixture(autouse=True)
def _restore_tables():
    """register_op writes ampfx's global tables: put them back after each test."""
    saved = [(t, dict(t)) for t in (ops.ENTRIES, ops.REGISTERED, ops._ALIASES, ops._BY_QUALNAME)]
    yield
    for table, items in saved:
        table.clear()
        table.update(items)


def _records(amp, fragment):
    return [r for r in amp.ampfx_report.records if fragment in r.op]


KEY_FORMS = {  # each names ampfxt::scale2 (the op) or its one overload
    "CustomOpDef": (scale2, "ampfxt::scale2"),
    "packet": (torch.ops.ampfxt.scale2, "ampfxt::scale2"),
    "overload": (torch.ops.ampfxt.scale2.default, "ampfxt::scale2.default"),
    "ns::op": ("ampfxt::scale2", "ampfxt::scale2"),
    "ns::op.overload": ("ampfxt::scale2.default", "ampfxt::scale2.default"),
    "ns.op": ("ampfxt.scale2", "ampfxt::scale2"),
    "torch.ops.ns.op": ("torch.ops.ampfxt.scale2", "ampfxt::scale2"),
    "torch.ops.ns.op.overload": ("torch.ops.ampfxt.scale2.default", "ampfxt::scale2.default"),
}
CALLS = {"CustomOpDef": scale2, "packet": torch.ops.ampfxt.scale2, "overload": torch.ops.ampfxt.scale2.default}


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("form", list(KEY_FORMS))
def test_every_key_form_puts_the_op_on_a_list(form, call, tracer):
    """A custom op named in any form on the allowlist runs in bfloat16 however the model calls it (unlisted, it
    stays float32): the record names it 'ns::op' (or the overload named), rule 'argument'; output close to float32."""
    key, name = KEY_FORMS[form]
    model = Scaled(CALLS[call])
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(X,), tracer=tracer, allowlist_add=(key,))
    (rec,) = _records(amp, "scale2")
    assert (rec.op, rec.rule, rec.dtype) == (name, "argument", torch.bfloat16)
    assert rel(amp(X), model(X)) < 2e-2
    plain = ampfx.convert(model, torch.bfloat16, example_inputs=(X,), tracer=tracer)
    (rec,) = _records(plain, "scale2")
    assert (rec.op, rec.rule, rec.dtype) == ("ampfxt::scale2", "unlisted", torch.float32)
    assert "AMPFX_ALLOWLIST_ADD / AMPFX_INFERLIST_ADD / ...=ampfxt::scale2" in rec.reason


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("spelling", ["ampfxt::scale2", "ampfxt.scale2", "torch.ops.ampfxt.scale2",
                                      "ampfxt::scale2.default"])
def test_env_variable_names_the_op(monkeypatch, spelling, tracer):
    """AMPFX_ALLOWLIST_ADD takes the op's names (as TF-AMP users set their own ops); the record names the variable."""
    monkeypatch.setenv("AMPFX_ALLOWLIST_ADD", spelling)
    model = Scaled(torch.ops.ampfxt.scale2.default)
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(X,), tracer=tracer)
    (rec,) = _records(amp, "scale2")
    assert (rec.rule, rec.dtype) == ("env:AMPFX_ALLOWLIST_ADD", torch.bfloat16)
    assert rel(amp(X), model(X)) < 2e-2


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_op_name_covers_every_overload_and_overload_name_only_itself(tracer):
    """'ns::op' covers all overloads; 'ns::op.overload' only that one, and is more specific than the op's name."""
    model = Overloads()
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(X,), tracer=tracer, allowlist_add=("ampfxt2::triple",))
    assert [(r.op, r.dtype) for r in _records(amp, "triple")] == [("ampfxt2::triple", torch.bfloat16)] * 2
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(X,), tracer=tracer,
                        allowlist_add=("ampfxt2::triple",), denylist_add=("ampfxt2::triple.scaled",))
    got = [(r.op, r.rule, r.dtype) for r in _records(amp, "triple")]
    assert got == [("ampfxt2::triple", "argument", torch.bfloat16), ("ampfxt2::triple.scaled", "argument", torch.float32)]
    assert rel(amp(X), model(X)) < 2e-2
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(X,), tracer=tracer,
                        allowlist_add=(torch.ops.ampfxt2.triple.scaled,))
    got = [(r.op, r.rule, r.dtype) for r in _records(amp, "triple")]
    assert got == [("ampfxt2::triple", "unlisted", torch.float32), ("ampfxt2::triple.scaled", "argument", torch.bfloat16)]


def test_packet_call_with_overloads_on_different_lists_is_an_error():
    """fx records torch.ops.ns.op(x) as the packet: which overload runs is unknown, so lists that treat the
    overloads differently are an error naming the fixes; the same lists on an exported graph (overloads) work."""
    model = Overloads(packet=True)
    lists = dict(allowlist_add=("ampfxt2::triple",), denylist_add=("ampfxt2::triple.scaled",))
    with pytest.raises(PolicyError, match=r"torch.ops.ampfxt2.triple\(...\) without naming an overload.*tracer='export'"):
        ampfx.convert(model, torch.bfloat16, example_inputs=(X,), tracer="fx", **lists)
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(X,), tracer="export", **lists)
    assert [r.dtype for r in _records(amp, "triple")] == [torch.bfloat16, torch.float32]
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(X,), tracer="fx", allowlist_add=("ampfxt2::triple",))
    assert [r.dtype for r in _records(amp, "triple")] == [torch.bfloat16, torch.bfloat16]


@pytest.mark.parametrize("spelling, message", [
    ("ampfxt::scale3", r"no op ampfxt::scale3 .*Did you mean 'ampfxt::scale2'\?"),
    ("ampfxt.scale3", r"unknown op 'ampfxt.scale3'.*Did you mean 'ampfxt::scale2'\?"),
    ("torch.ops.ampfxt.scael2", r"no op ampfxt::scael2 .*Did you mean 'ampfxt::scale2'\?"),
    ("notloadedlib::op", r"no op namespace 'notloadedlib' loaded.*Import the library .*before ampfx.convert"),
    ("ampfxt::scale2.out", r"ampfxt::scale2 has no overload 'out'; its overloads: default"),
    ("ampfxt2::tripel", r"Did you mean 'ampfxt2::triple'\?"),
])
def test_unknown_names_are_errors_with_a_close_match(spelling, message):
    """A name torch does not know is rejected, in a Policy and in an env variable, never accepted silently."""
    with pytest.raises(PolicyError, match=message):
        Policy(denylist_add=(spelling,))
    with pytest.raises(PolicyError, match=rf"AMPFX_DENYLIST_ADD=.*{message}"):
        from_env(Policy(), {"AMPFX_DENYLIST_ADD": spelling})


def test_registered_op_is_a_table_entry_that_policy_and_env_override(monkeypatch):
    """register_op gives the default (rule 'table', reason 'registered by <library>'); a Policy edit overrides it,
    and the environment overrides both (precedence table < argument < env)."""
    assert ampfx.register_op(scale2, "allow", reason="x*2 is exact", library="mylib") == "ampfxt::scale2"
    model = Scaled()
    (rec,) = _records(ampfx.convert(model, torch.bfloat16, example_inputs=(X,)), "scale2")
    assert (rec.rule, rec.dtype, rec.reason) == ("table", torch.bfloat16, "registered by mylib: x*2 is exact")
    moved = dict(denylist_add=("ampfxt::scale2",), allowlist_remove=("ampfxt::scale2",))
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(X,), **moved)
    (rec,) = _records(amp, "scale2")
    assert (rec.rule, rec.dtype) == ("argument", torch.float32)
    monkeypatch.setenv("AMPFX_ALLOWLIST_ADD", "ampfxt::scale2")
    monkeypatch.setenv("AMPFX_DENYLIST_REMOVE", "ampfxt.scale2")
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(X,), **moved)
    (rec,) = _records(amp, "scale2")
    assert (rec.rule, rec.dtype) == ("env:AMPFX_ALLOWLIST_ADD", torch.bfloat16)
    assert rel(amp(X), model(X)) < 2e-2


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8) + 1e-3)

    def forward(self, x):
        return self.a(torch.ops.ampfxt2.mix(self.a(x), self.w))


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("slot", [1, "w"])
def test_registered_fp32_args_reach_the_kernel_in_float32(slot, tracer):
    """fp32_args of a registered op: the kernel gets that argument in float32 while the op runs low; the
    overload named alone on a list keeps the op's fp32_args."""
    ampfx.register_op("ampfxt2::mix", Category.ALLOW, reason="scaled by a float32 weight", fp32_args=(slot,))
    model = Mixed()
    for lists in ({}, {"allowlist_add": ("ampfxt2::mix.default",)}):
        amp = ampfx.convert(model, torch.bfloat16, example_inputs=(X,), tracer=tracer, **lists)
        (rec,) = _records(amp, "mix")
        assert rec.dtype == torch.bfloat16
        SEEN.clear()
        out = amp(X)
        assert SEEN == [(torch.bfloat16, torch.float32)]
        assert rel(out, model(X)) < 2e-2


def test_register_op_rejects_bad_calls():
    """Bad category, not an op, one of torch's/ampfx's own ops, an unloaded name, a slot the op lacks, no reason,
    a second registration with another rule (unless replace=True); the same registration again is a no-op."""
    with pytest.raises(OpRegistrationError, match=r"category 'alow' is not a list.*Did you mean 'allow'\?"):
        ampfx.register_op(scale2, "alow", reason="r")
    with pytest.raises(OpRegistrationError, match=r"category 'fp32' is not a list"):
        ampfx.register_op(scale2, "fp32", reason="r")
    for target in (42, nn.Linear, "not an op"):
        with pytest.raises(OpRegistrationError, match=r"not an op"):
            ampfx.register_op(target, "deny", reason="r")
    for builtin in (torch.ops.aten.relu.default, "aten::digamma", torch.nn.functional.gelu):
        with pytest.raises(OpRegistrationError, match=r"own ops|already ampfx's op"):
            ampfx.register_op(builtin, "deny", reason="r")
    with pytest.raises(OpRegistrationError, match=r"no op namespace 'notloadedlib' loaded"):
        ampfx.register_op("notloadedlib::op", "deny", reason="r")
    with pytest.raises(OpRegistrationError, match=r"fp32_args slot 'weight' is not an argument.*0:x, 1:w"):
        ampfx.register_op("ampfxt2::mix", "allow", reason="r", fp32_args=("weight",))
    with pytest.raises(OpRegistrationError, match=r"give reason="):
        ampfx.register_op(scale2, "deny", reason=" ")
    ampfx.register_op(scale2, "deny", reason="r", library="mylib")
    ampfx.register_op(torch.ops.ampfxt.scale2, "deny", reason="r", library="mylib")  # the same rule: no-op
    with pytest.raises(OpRegistrationError, match=r"already registered by mylib as deny.*replace=True"):
        ampfx.register_op("ampfxt::scale2", "allow", reason="r", library="mylib")
    ampfx.register_op("ampfxt::scale2", "allow", reason="r", library="mylib", replace=True)
    assert Policy().category_of("ampfxt::scale2")[0] is Category.ALLOW


def test_register_op_per_dtype_variant_and_python_function():
    """fp16= gives another list under float16; a Python function is registered by its qualified name and kept
    whole by the tracer."""
    ampfx.register_op(scale2, "allow", reason="x*2", fp16="deny")
    assert Policy("bf16").category_of("ampfxt::scale2")[0] is Category.ALLOW
    assert Policy("fp16").category_of("ampfxt::scale2")[0] is Category.DENY

    name = ampfx.register_op(_halve, "deny", reason="needs range", library="mylib")
    amp = ampfx.convert(Halved(), torch.bfloat16, example_inputs=(X,))
    (rec,) = [r for r in amp.ampfx_report.records if r.op == name]
    assert (rec.rule, rec.dtype, rec.reason) == ("table", torch.float32, "registered by mylib: needs range")


def _halve(x):
    return x * 0.5


class Halved(Scaled):
    def forward(self, x):
        return self.b(_halve(self.a(x)))


def test_cli_lists_shows_registered_ops(capsys):
    """`ampfx lists` shows a registered op on its list with who registered it."""
    ampfx.register_op(scale2, "infer", reason="elementwise", library="mylib")
    assert cli.main(["lists"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if "ampfxt::scale2" in l)
    assert "[table] registered by mylib: elementwise" in line


@torch.library.custom_op("ampfxt::bump", mutates_args=("x",))
def bump(x: torch.Tensor) -> None:
    x.add_(1)


bump.register_fake(lambda x: None)


class Bumped(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        y = torch.softmax(self.a(x), -1)
        bump(y)
        return self.a(y), y


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_op_that_writes_its_argument_is_inplace(tracer):
    """A custom op whose schema writes an argument (mutates_args) computes on the tensor it writes, never on a cast
    copy (rule 'inplace'), even on the allowlist: the float32 tensor the model returns carries the write."""
    model = Bumped()
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(X,), tracer=tracer, allowlist_add=(bump,))
    (rec,) = _records(amp, "bump")
    assert (rec.rule, rec.dtype, rec.inplace) == ("inplace", torch.float32, True)
    (out, y), (want_out, want_y) = amp(X), model(X)
    assert y.dtype == torch.float32 and y.min() > 1 and rel(y, want_y) < 1e-2 and rel(out, want_out) < 2e-2


def test_exported_graph_keeps_the_ops_own_backward():
    """torch.library runs a custom op's autograd kernel as an autograd.Function inside the op; the exported graph
    holds the op itself, so the capture is kept (method 'export') and gradients match the model's."""
    model = Scaled()
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(X,), tracer="export", allowlist_add=(scale2,))
    assert [r.method for r in amp.ampfx_report.parts] == ["export"]
    (got,) = torch.autograd.grad(amp(X).sum(), model.a.weight)  # the converted module shares the parameters
    (want,) = torch.autograd.grad(model(X).sum(), model.a.weight)
    assert rel(got, want) < 2e-2
