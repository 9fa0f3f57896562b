"""Call-time guards (issue #17, cases 3, 4, 5, 14 and their neighbours): a converted module gives the
model's result or raises an ampfx error naming the input, what it was converted for and the fix."""
import copy
import pickle

import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx.errors import ExampleInputsError, GuardError
from ampfx.errors import PolicyError
from conftest import rel


class SumList(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, xs):
        out = 0
        for x in xs:
            out = out + self.lin(x)
        return out


class OptionalKey(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, d):
        out = self.lin(d["a"])
        if "b" in d:
            out = out + self.lin(d["b"])
        return out


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16)

    def forward(self, x):
        q = self.q(x)
        return (q @ q.transpose(-1, -2)).softmax(-1) @ q


class ShapeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if x.shape[0] > 4:
            h = h * 2
        return h


class Repeat(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, n: int = 5):
        h = self.lin(x)
        for _ in range(n):
            h = h * 1.5
        return h


class Flagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, scale=None):
        h = self.fc(x)
        if scale is not None:
            h = h * scale
        return h


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# -- case 3: list lengths and dict keys --------------------------------------------------------------------------

@pytest.mark.parametrize("n", [5, 2])
def test_a_list_of_another_length_raises_naming_the_input(n):
    """A list argument captured with 3 elements: 5 or 2 elements raise GuardError (no silent drop, no IndexError
    from torch's pytree code), naming the argument, the length it was converted for and the fix."""
    amp = ampfx.convert(SumList(), example_inputs=([torch.randn(2, 4) for _ in range(3)],))
    with pytest.raises(GuardError, match=r"input xs .* is list of %d, but it was converted for a list of 3.*Fix:" % n):
        amp([torch.randn(2, 4) for _ in range(n)])


def test_a_list_of_the_example_length_gives_the_model_result():
    """The guard lets through what the module was built for: other values, same structure."""
    model = SumList()
    amp = ampfx.convert(model, example_inputs=([torch.randn(2, 4) for _ in range(3)],))
    xs = [torch.randn(2, 4) for _ in range(3)]
    assert rel(amp(xs), model(xs)) < 0.03


def test_a_dict_with_a_key_the_example_lacked_raises():
    """A dict input captured with keys ['a'] does not silently ignore an extra key 'b' the model reads."""
    amp = ampfx.convert(OptionalKey(), example_inputs=({"a": torch.randn(2, 4)},))
    with pytest.raises(GuardError, match=r"input d .*dict with keys \['a', 'b'\].*converted for a dict with keys \['a'\]"):
        amp({"a": torch.randn(2, 4), "b": torch.randn(2, 4)})


# -- case 4: padding bakes the example's sizes -------------------------------------------------------------------

@pytest.mark.parametrize("length", [7, 13, 17])
def test_pad_always_at_another_sequence_length_raises(length):
    """pad='always' padded the attention's N (the sequence length, 10) and narrows back to it: other lengths raise
    GuardError naming x's dim 1 and the fix (dynamic_dims), never a wrong shape or a torch shape error."""
    amp = ampfx.convert(Attention(), example_inputs=(torch.randn(2, 10, 16),), pad="always")
    with pytest.raises(GuardError, match=r"input x .*dim 1 is %d, but it was converted for 10.*pad='always'.*"
                                         r"dynamic_dims=\{1: 'name'\}" % length):
        amp(torch.randn(2, length, 16))


def test_pad_always_leaves_sizes_it_did_not_pad_free():
    """Only the sizes padding depends on are fixed: another batch size gives the model's result."""
    model = Attention()
    amp = ampfx.convert(model, example_inputs=(torch.randn(2, 10, 16),), pad="always")
    assert any(n.target is ampfx.runtime.cast_pad for n in amp.graph.nodes)
    x = torch.randn(5, 10, 16)
    assert amp(x).shape == model(x).shape and rel(amp(x), model(x)) < 0.03


@pytest.mark.parametrize("length", [7, 13, 17])
def test_pad_with_the_length_dynamic_is_right_at_every_length(length):
    """dynamic_dims is the documented way to accept other sizes: padding skips the symbolic sequence length."""
    model = Attention()
    amp = ampfx.convert(model, example_inputs=(torch.randn(2, 10, 16),), pad="always", dynamic_dims={1: "seq"})
    x = torch.randn(2, length, 16)
    assert amp(x).shape == model(x).shape and rel(amp(x), model(x)) < 0.03


# -- case 5: integer example inputs for a float model ------------------------------------------------------------

def test_integer_example_inputs_for_a_float_model_fail_at_convert():
    """The model does not run on its int64 example: convert() says so, naming the dtype, instead of returning a
    module that fails later."""
    with pytest.raises(ExampleInputsError, match=r"does not run on example_inputs.*int64\[2, 4\]"):
        ampfx.convert(mlp(), example_inputs=(torch.ones(2, 4, dtype=torch.long),))


def test_integer_example_with_tracer_fx_rejects_float_calls_clearly():
    """tracer='fx' runs nothing at convert time; the module converted for an integer input raises GuardError on a
    float one (it decided every op's dtype for integers), naming the kinds."""
    amp = ampfx.convert(mlp(), example_inputs=(torch.ones(2, 4, dtype=torch.long),), tracer="fx")
    with pytest.raises(GuardError, match=r"float32\[2, 4\], but it was converted for an integer tensor"):
        amp(torch.randn(2, 4))


def test_a_float_module_called_with_integers_raises():
    """The other way round: converted for float32, called with int64."""
    amp = ampfx.convert(mlp(), example_inputs=(torch.randn(2, 4),))
    with pytest.raises(GuardError, match=r"int64\[2, 4\], but it was converted for a floating-point tensor"):
        amp(torch.ones(2, 4, dtype=torch.long))


def test_a_non_tensor_where_the_example_had_a_tensor_raises():
    amp = ampfx.convert(mlp(), example_inputs=(torch.randn(2, 4),))
    with pytest.raises(GuardError, match=r"is 3.0, but it was converted for a floating-point tensor"):
        amp(3.0)


# -- case 14: export's specialised sizes -------------------------------------------------------------------------

def test_a_shape_branch_under_export_raises_outside_its_range():
    """`if x.shape[0] > 4` converted with batch 8 (torch.export, range 5..): batch 2 raises GuardError (it gave a
    relative error of 0.64 before), naming the range; batch 6 gives the model's result."""
    model = ShapeBranch()
    amp = ampfx.convert(model, example_inputs=(torch.randn(8, 4),))
    assert amp.ampfx_report.parts[0].method == "export"
    with pytest.raises(GuardError, match=r"dim 0 is 2, but it was converted for sizes 5\.\."):
        amp(torch.randn(2, 4))
    x = torch.randn(6, 4)
    assert rel(amp(x), model(x)) < 0.03


def test_export_specialises_an_example_size_of_one():
    """torch.export fixes sizes 0 and 1: converted with batch 1, batch 4 raises with the fix (an example of 2+)."""
    amp = ampfx.convert(ShapeBranch(), example_inputs=(torch.randn(1, 4),), tracer="export")
    with pytest.raises(GuardError, match=r"dim 0 is 4, but it was converted for 1.*size 2 or more"):
        amp(torch.randn(4, 4))


def test_a_python_int_baked_by_export_converts_again_for_another_value():
    """export bakes `n=3` into the graph (it silently used 3 for n=5 once): n=5 converts again, as a changed
    attribute does (the conversion in variants(), its report naming the input), and computes with 5; n=3 runs
    the first graph, n=5 again the variant. With reconvert_limit=0 it raises GuardError naming the value."""
    model = Repeat()
    x = torch.randn(2, 4)
    amp = ampfx.convert(model, example_inputs=(x, 3))
    assert amp.ampfx_report.parts[0].method == "export"
    assert rel(amp(x, 5), model(x, 5)) < 0.03
    (variant,) = amp.variants()
    assert any("input n of the converted module is 5, but it was converted for 3" in n
               for n in variant.ampfx_report.notes), variant.ampfx_report.notes
    assert rel(amp(x, 3), model(x, 3)) < 0.03 and rel(amp(x, 5), model(x, 5)) < 0.03
    assert len(amp.variants()) == 1
    strict = ampfx.convert(model, example_inputs=(x, 3), reconvert_limit=0)
    with pytest.raises(GuardError, match=r"input n .* is 5, but it was converted for 3.*baked"):
        strict(x, 5)


def test_export_rank_is_fixed_but_fx_rank_is_free():
    """A 3-D input to a module exported with a 2-D example raises GuardError; torch.fx's graph keeps no sizes and
    gives the model's result at another rank."""
    model = ShapeBranch()
    exported = ampfx.convert(model, example_inputs=(torch.randn(8, 4),), tracer="export")
    with pytest.raises(GuardError, match=r"converted for a tensor of rank 2"):
        exported(torch.randn(8, 3, 4))
    net = mlp()
    traced = ampfx.convert(net, example_inputs=(torch.randn(8, 4),))
    x = torch.randn(3, 5, 4)
    assert rel(traced(x), net(x)) < 0.03


# -- values fixed while tracing ----------------------------------------------------------------------------------

def test_an_argument_fx_fixed_at_its_default_converts_again_or_raises_a_guard_error():
    """fx traced `scale` as None; passing one converts again for it (the model's result, the conversion in
    variants()); with reconvert_limit=0 it raises GuardError naming the input and the fix."""
    torch.manual_seed(0)
    model, x, scale = Flagged(), torch.randn(2, 4), torch.tensor(2.0)
    amp = ampfx.convert(model, example_inputs=(x,), tracer="fx")
    assert rel(amp(x, scale=scale), model(x, scale=scale)) < 0.03 and len(amp.variants()) == 1
    assert rel(amp(x), model(x)) < 0.03
    strict = ampfx.convert(model, example_inputs=(x,), tracer="fx", reconvert_limit=0)
    with pytest.raises(GuardError, match=r"input scale .*converted for None.*example_inputs that give scale"):
        strict(x, scale=scale)


def test_keyword_calls_are_checked_like_positional_ones():
    """The guard binds keywords to forward's arguments: amp(x=...) is checked too."""
    amp = ampfx.convert(mlp(), example_inputs=(torch.randn(2, 4),))
    name = next(iter(__import__("inspect").signature(amp.forward).parameters))
    with pytest.raises(GuardError):
        amp(**{name: torch.ones(2, 4, dtype=torch.long)})



class Extras(nn.Module):
    """A forward with *args, a keyword-only argument and **kwargs (as HF models have)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, *rest, scale=2.0, **extra):
        return self.fc(x) * scale


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_forwards_with_star_args_and_keyword_only_arguments_are_checked(tracer):
    """The guard binds calls to a forward with *args / keyword-only / **kwargs: x is checked given positionally
    or by keyword, also when other keywords go into **kwargs; a call the forward rejects keeps its TypeError."""
    model = Extras()
    amp = ampfx.convert(model, example_inputs=(torch.randn(2, 4),), tracer=tracer)
    x, bad = torch.randn(2, 4), torch.ones(2, 4, dtype=torch.long)
    assert rel(amp(x), model(x)) < 0.03 and rel(amp(x=x), model(x)) < 0.03
    for args, kwargs in [((bad,), {}), ((), {"x": bad}), ((bad,), {"scale": 2.0}), ((), {"x": bad, "other": 1})]:
        with pytest.raises(GuardError, match="converted for a floating-point tensor"):
            amp(*args, **kwargs)
    with pytest.raises(TypeError, match="multiple values"):
        amp(x, x=x)


def test_the_guard_binds_every_call_as_inspect_binds_it():
    """Rule: the guard's quick binding (calls within forward's leading positional parameters, keywords naming the
    others or going into **kwargs) gives each parameter the value inspect.Signature.bind gives it; a call it
    cannot bind quickly goes through inspect, and one the forward rejects binds to nothing."""
    import inspect

    from ampfx.runtime.guards import _MISSING, Guard, Signature

    def hf(x, mask=None, *, scale=2.0, **extra):
        pass

    def star(x, *rest, scale=2.0, **extra):
        pass

    def plain(x, y=1, z=2):
        pass

    calls = [((1,), {}), ((1,), {"mask": 2}), ((), {"x": 1, "other": 3}), ((1, 2), {"scale": 4, "a": 5, "b": 6}),
             ((1,), {"extra": 7}), ((1, 2, 3), {}), ((1,), {"x": 1}), ((1,), {"z": 3, "y": 2})]
    # (a call missing a required argument binds it as missing: forward itself raises its TypeError)
    for fn in (hf, star, plain):
        sig = inspect.signature(fn)
        params = tuple((n, int(p.kind), p.default) for n, p in sig.parameters.items())
        guard = Guard(Signature("m", params, (None,) * len(params)))
        for args, kwargs in calls:
            try:
                bound = sig.bind(*args, **kwargs).arguments
                want = [bound.get(n, _MISSING) for n in sig.parameters]
            except TypeError:
                want = None
            assert guard._bind(args, kwargs) == want, (fn.__name__, args, kwargs)


# -- dynamic_dims checked at convert -----------------------------------------------------------------------------

@pytest.mark.parametrize("dims, words", [
    ({5: "b"}, "dim 5, but the example inputs' tensors have at most 2"),
    ({-3: "b"}, "dim -3"),
    ({0: 3}, "identifier string"),
    ({0: "two words"}, "identifier string"),
    ({"0": "b"}, "dimension numbers"),
    ({True: "b"}, "dimension numbers"),
    ([0], "must be a dict"),
    ({1: "a", -1: "b"}, "twice"),
])
def test_bad_dynamic_dims_raise_a_policy_error(dims, words):
    """dynamic_dims naming no dimension of the example, a non-int dim or a non-name is an error, not ignored."""
    with pytest.raises(PolicyError, match=words):
        ampfx.convert(mlp(), example_inputs=(torch.randn(8, 4),), dynamic_dims=dims)


def test_dynamic_dims_on_a_size_one_dimension_raise():
    with pytest.raises(PolicyError, match="size 2 or more"):
        ampfx.convert(mlp(), example_inputs=(torch.randn(1, 4),), dynamic_dims={0: "batch"})


def test_negative_dynamic_dims_are_accepted():
    model = Attention()
    amp = ampfx.convert(model, example_inputs=(torch.randn(2, 10, 16),), dynamic_dims={-2: "seq"})
    x = torch.randn(2, 7, 16)
    assert rel(amp(x), model(x)) < 0.03


# -- the guard travels with the module; nothing to check, no guard -----------------------------------------------

def test_the_guard_survives_deepcopy_and_pickle():
    """Copies keep the guard. (Pickling an exported module with a list input fails on main already: its
    re-traced code unpacks the list as one value; not a guard matter, so a tensor input here.)"""
    amp = ampfx.convert(SumList(), example_inputs=([torch.randn(2, 4) for _ in range(3)],))
    other = copy.deepcopy(amp)
    with pytest.raises(GuardError, match="list of 3"):
        other([torch.randn(2, 4)])
    other([torch.randn(2, 4) for _ in range(3)])
    amp = ampfx.convert(ShapeBranch(), example_inputs=(torch.randn(8, 4),))
    for other in (copy.deepcopy(amp), pickle.loads(pickle.dumps(amp))):
        with pytest.raises(GuardError, match="sizes 5"):
            other(torch.randn(2, 4))
        other(torch.randn(6, 4))


def test_without_example_inputs_sizes_and_kinds_are_not_guarded():
    """Converted without example inputs nothing was specialised: no guard, any batch or rank runs."""
    net = mlp()
    amp = ampfx.convert(net)
    assert amp._rt.guard is None
    x = torch.randn(3, 2, 4)
    assert rel(amp(x), net(x)) < 0.03


def test_guard_errors_are_value_errors():
    """Existing `except ValueError` clauses keep working."""
    assert issubclass(GuardError, ValueError) and issubclass(ExampleInputsError, ValueError)


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, mask):
        y = self.lin(x)
        return y if mask is None else y.masked_fill(mask, 0.0)


class _Gated(nn.Module):
    """Python no capture keeps (a value read with ``.item()``) around a child it calls with what it decides: a mask
    or ``None``, the whole batch or one row."""

    def __init__(self):
        super().__init__()
        self.block = _Masked()

    def forward(self, x, masked: bool = True, rows: int = 0):
        if x.sum().item() > 1e9:
            return x
        x = x[:rows] if rows else x
        return self.block(x, (x > 1.0) if masked else None)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_module_the_models_python_calls_outside_its_signature_is_converted_again_for_the_call(tracer):
    """A module below the root is called by the model's own Python, with what that passes: a mask left ``None``,
    one row at inference (torch.export's graph holds for two rows and more). Outside its signature it is converted
    again for that call (the right numbers, a new entry), never run as it is and never a GuardError the user cannot
    fix at the call they make; the root, which the user calls, still raises one (see above)."""
    model = _Gated()
    x = torch.randn(4, 8)
    amp = ampfx.convert(model, example_inputs=(x,), tracer=tracer, gemm_min_flops=0)
    for kwargs in ({"masked": False}, {"rows": 1}):
        torch.testing.assert_close(amp(x, **kwargs).float(), model(x, **kwargs), atol=0.05, rtol=0.05)
    # fx's graph holds for any rows (one entry, for the mask); export's for two rows and more (two)
    assert len(amp.block.variants()) == {"fx": 1, "export": 2}[tracer]
    assert amp.block.variants()[0].ampfx_report  # each entry made again carries its own log


def test_a_module_below_the_root_is_not_converted_again_inside_checkpointing_nor_for_the_users_own_bad_input():
    """Outside its signature inside activation checkpointing (a conversion runs its own backward, which checkpoint's
    hooks would take for its recompute) the module raises its GuardError, as it does where converting again fails
    (an integer input the user passed through the model's Python: still a ValueError, naming the input)."""
    import torch.utils.checkpoint as cp

    model = _Gated()
    amp = ampfx.convert(model, example_inputs=(torch.randn(4, 8),), tracer="export", gemm_min_flops=0)
    one = torch.randn(1, 8, requires_grad=True)
    with pytest.raises(GuardError, match="dim 0 is 1"):
        cp.checkpoint(amp, one, use_reentrant=False)
    assert amp.block.variants() == []
    with pytest.raises(GuardError, match="int64"):
        amp(torch.ones(4, 8, dtype=torch.int64))
    out = amp(one, rows=0)  # outside checkpointing: converted again for one row
    torch.testing.assert_close(out.float(), model(one), atol=0.05, rtol=0.05)
