"""Models that converted into a crash, or into an error that named the wrong cause: each now gives the
model's result, or an ampfx error naming the real cause and a fix that works."""
import copy
import inspect

import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx import ops
from ampfx.errors import GuardError
from conftest import DTYPES, rel


# -- optional non-tensor arguments fixed while tracing -------------------------------------------------------------

class Flag(nn.Module):
    """Python control flow on a bool argument, and a tuple argument read by index."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(s, x, flag=False, mix=(0.5, 0.5)):  # noqa: N805 - not called self: torch.fx's pytree code broke on it
        y = s.l(x)
        if flag:
            y = y * mix[0]
        return y * mix[1]


@pytest.mark.parametrize("tracer", ["auto", "fx"])
def test_fixed_container_and_bool_defaults_convert_and_are_guarded(tracer):
    """Arguments torch.fx fixed at their defaults, a tuple among them, keep forward's signature (one
    argument each, with its default, in forward's order): calls at those values, by position or
    keyword, give the model's result; any other value converts again for it (the model's result), or, with
    reconvert_limit=0, raises GuardError naming the argument and the fix, never a graph built for the defaults."""
    model, x = Flag(), torch.randn(3, 4)
    again = ampfx.convert(model, example_inputs=(x,), tracer=tracer)
    assert rel(again(x, True, (0.1, 0.9)), model(x, True, (0.1, 0.9))) < 0.03 and len(again.variants()) == 1
    amp = ampfx.convert(model, example_inputs=(x,), tracer=tracer, reconvert_limit=0)
    assert amp.ampfx_report.parts[0].method == "fx, optional arguments fixed"
    params = inspect.signature(amp.forward).parameters
    assert [(p.name, p.default) for p in params.values()][1:] == [("flag", False), ("mix", (0.5, 0.5))]
    want = model(x)
    for args, kwargs in [((x,), {}), ((x, False), {}), ((x, False, (0.5, 0.5)), {}),
                         ((x,), {"mix": (0.5, 0.5)}), ((), {"x": x, "flag": False, "mix": (0.5, 0.5)})]:
        assert rel(amp(*args, **kwargs), want) < 0.03, (args, kwargs)
    for args, kwargs, name in [((x,), {"flag": True}, "flag"), ((x, True), {}, "flag"),
                               ((x,), {"mix": (0.1, 0.9)}, "mix"), ((x, False, (0.1, 0.9)), {}, "mix")]:
        with pytest.raises(GuardError, match=rf"input {name} .*fixed it while tracing.*example_inputs that give {name}"):
            amp(*args, **kwargs)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x, mask=None, output_attentions=False):
        return (self.l(x),) + ((x,) if output_attentions else ())


class _Encoder(nn.Module):
    """A Hugging Face encoder's shape: optional arguments, one read by ``if``, another after it."""

    def __init__(self):
        super().__init__()
        self.layer = nn.ModuleList([_Block(), _Block()])

    def forward(self, x, mask=None, output_attentions=False, output_hidden_states=False):
        if output_attentions:
            x = x * 2
        for block in self.layer:
            x = block(x, None, output_attentions=output_attentions)[0]
        return x


class _EagerRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = _Encoder()

    def forward(self, x):
        if x.sum() > 1e9:  # data-dependent: the root keeps its Python, its encoder is a part
            return x
        return self.enc(x, None, output_attentions=False, output_hidden_states=False)


def test_a_part_with_a_fixed_flag_before_another_argument_converts_without_example_inputs():
    """Without example inputs every input of a part is presumed float32, a fixed ``output_attentions`` too:
    its input cast was placed after the last placeholder while the check of its fixed value, which comes
    before that placeholder, was made to read it (the graph failed its lint: a Hugging Face BERT converted
    without example inputs crashed so). The checks read the argument as handed; the model's result."""
    model, x = _EagerRoot(), torch.randn(2, 4)
    amp = ampfx.convert(model, "bf16")
    assert ("enc", "fx, optional arguments fixed") in [(p.path, p.method) for p in amp.ampfx_report.parts]
    assert rel(amp(x), model(x)) < 0.03


# -- Fourier transforms after a low-precision op -------------------------------------------------------------------

class Spectral(nn.Module):
    """A linear layer, then a real FFT, a complex product, and back (an FNet / FNO-style spectral mix)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        z = torch.fft.rfft(self.l(x))
        y = torch.fft.irfft(z * 0.5, n=16) + torch.fft.fft2(self.l(x)).real
        return self.out(y)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fft_after_a_low_precision_op_runs_in_float32(dtype, tracer):
    """The torch.fft functions (and the ATen ops torch.export records for them) are on the deny list: an FFT
    of a low-precision linear's output reads it in float32 (no bfloat16/float16 FFT kernel on CPU), the
    converted module gives the float32 model's result, and the FFT's record says float32 with the deny
    list's reason."""
    torch.manual_seed(0)
    model, x = Spectral(), torch.randn(4, 16)
    amp = ampfx.convert(model, dtype, example_inputs=(x,), tracer=tracer)
    assert rel(amp(x), model(x)) < 0.03
    for op in ("rfft", "fft2"):
        rec = next(r for r in amp.ampfx_report.records if r.op == op)
        assert (rec.dtype, rec.category, rec.reason) == (torch.float32, ops.Category.DENY, ops.ENTRIES[op].reason)
    assert amp.ampfx_report.by_node("linear").dtype == dtype
    assert ops.lookup_name(torch.ops.aten._fft_r2c.default) == "rfft"
    assert ops.lookup_name(torch.ops.aten._fft_c2r.default) == "irfft"


class MakesComplex(nn.Module):
    """Complex numbers built from a low-precision linear's output, by ops on no list or on the clear list."""

    def __init__(self, how):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.how = how

    def forward(self, x):
        y = self.l(x)
        if self.how == "complex":
            z = torch.complex(y, y.flip(-1))
        else:
            z = torch.view_as_complex(y.reshape(4, 4, 2))
        return z.abs()


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("how", ["complex", "view_as_complex"])
def test_an_op_making_complex_from_real_data_reads_float32(how, tracer):
    """An op that makes complex numbers from real float data reads it in float32 (bfloat16 has no complex
    dtype), where it used to run as written on bfloat16 data and fail: torch.complex is on no list (rule
    unlisted), view_as_complex is a clear op under torch.export (rule complex). The converted module gives
    the model's result."""
    model, x = MakesComplex(how), torch.randn(4, 8)
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(x,), tracer=tracer)
    assert amp.ampfx_report.parts[0].method == tracer
    assert rel(amp(x), model(x)) < 0.03
    made = next(r for r in amp.ampfx_report.records if r.node.startswith(("complex", "view_as_complex")))
    rule = "complex" if (how, tracer) == ("view_as_complex", "export") else "unlisted"
    assert (made.dtype, made.rule) == (torch.float32, rule)


# -- a cache the forward grows for longer inputs ---------------------------------------------------------------------

class Rope(nn.Module):
    """A position table grown by the forward when a longer sequence comes (a rotary-embedding cache)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.cache_len = 0
        self.cache = None

    def forward(self, x):
        T = x.shape[1]
        if T > self.cache_len:
            self.cache = torch.arange(T, dtype=torch.float32)[:, None].expand(T, 8).clone()
            self.cache_len = T
        return self.l(x) + self.cache[:T]


class PrecomputedRope(nn.Module):
    """As HF's rotary embeddings: a buffer precomputed to a length in __init__, re-registered longer when needed."""

    def __init__(self, length=4):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self._set_cache(length)

    def _set_cache(self, length):
        self.max_seq_len_cached = length
        t = torch.arange(length, dtype=torch.float32)[:, None].expand(length, 8)
        self.register_buffer("cos_cached", t.cos(), persistent=False)

    def forward(self, x):
        T = x.shape[1]
        if T > self.max_seq_len_cached:
            self._set_cache(T)
        return self.l(x) * self.cos_cached[:T]


class Head(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.block(x))


def _warm_rope():
    rope = Rope()
    rope(torch.randn(2, 4, 8))  # the cache already holds 4 positions, as after any earlier call
    return rope


@pytest.mark.parametrize("tracer", ["auto", "fx", "export"])
@pytest.mark.parametrize("build", [Rope, _warm_rope, PrecomputedRope, lambda: Head(_warm_rope()),
                                   lambda: Head(PrecomputedRope())],
                         ids=["cold-rope", "rope", "precomputed", "head-rope", "head-precomputed"])
def test_a_cache_the_forward_grows_keeps_its_python(build, tracer):
    """A module whose forward grows a cache for longer inputs keeps its Python, so calls longer and shorter
    than the example give the model's result. torch.export's graph of it holds only up to the cache's
    length at conversion (the branch that grows it is not taken on the example), and converting again
    cannot help since the model sets that length itself: where a run one past that length shows the
    forward setting Python state, the graph is not used (it used to raise GuardError for longer calls)."""
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    rope = model.block if isinstance(model, Head) else model
    lengths = {k: v for k, v in vars(rope).items() if k in ("cache_len", "max_seq_len_cached")}
    amp = ampfx.convert(model, example_inputs=(torch.randn(2, 4, 8),), tracer=tracer)
    assert {k: vars(rope)[k] for k in lengths} == lengths  # the model is left as it was
    assert not any(r.method == "export" and r.path in ("", "block") for r in amp.ampfx_report.parts)
    for T in (16, 2, 4, 20):
        x = torch.randn(2, T, 8)
        assert rel(amp(x), reference(x)) < 0.03, T


# -- out= writes ------------------------------------------------------------------------------------------------------

class OutInto(nn.Module):
    """Writes a linear's result with out= into a buffer, into a tensor the forward makes, or into one made like a
    traced value, then reads that tensor."""

    def __init__(self, into, op):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.register_buffer("buf", torch.zeros(3, 4))
        self.into, self.op = into, op

    def forward(self, x):
        y = self.l(x)
        o = self.buf if self.into == "buffer" else torch.empty(3, 4) if self.into == "fresh" else torch.empty_like(y)
        if self.op == "add":
            torch.add(y, 1.0, out=o)
        else:
            torch.mm(y, self.l.weight, out=o)
        return o * 2


@pytest.mark.parametrize("tracer", ["auto", "fx", "export"])
@pytest.mark.parametrize("op", ["add", "mm"])
@pytest.mark.parametrize("into", ["buffer", "fresh", "like"])
def test_out_writes_convert_under_no_grad_and_give_the_model_result(into, op, tracer):
    """A forward that writes with out= (which autograd refuses, so the model runs only under no_grad) converts
    under torch.no_grad() and gives the model's result and buffer: the check of the torch.fx graph runs the
    model without autograd when it fails only with it (it used to blame the example inputs); torch.fx's graph
    of an out= write into a buffer or a tensor made while tracing is not used (its later reads were computed
    while tracing); an out= op computes in the dtype of the tensor it writes (torch.mm refuses any other)."""
    model = OutInto(into, op)
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    with torch.no_grad():
        amp = ampfx.convert(model, torch.bfloat16, example_inputs=(x,), tracer=tracer)
        for _ in range(2):
            x = torch.randn(3, 4)
            assert rel(amp(x), reference(x)) < 0.03
            assert rel(model.buf + 1, reference.buf + 1) < 0.03  # the write reached the model's own buffer
    if into != "like":
        assert all(r.method != "fx" for r in amp.ampfx_report.parts if r.path == "")
    elif tracer != "export":
        rec = next(r for r in amp.ampfx_report.records if r.op in ("add", "mm"))
        assert (rec.dtype, rec.rule) == (amp.ampfx_report.by_node("empty_like").out, "inplace")


def test_out_write_with_autograd_fails_as_the_model_does():
    """Converted with autograd on, an out= forward converts (its example inputs are not what is wrong), and a call
    with autograd raises torch's own error naming out=, as the model's call does."""
    model = OutInto("buffer", "add")
    x = torch.randn(3, 4)
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(x,))
    for module in (model, amp):
        with pytest.raises(RuntimeError, match=r"out=\.\.\. arguments don't support automatic differentiation"):
            module(x)


# -- a buffer the forward re-assigns ----------------------------------------------------------------------------------

class Counted(nn.Module):
    """A submodule whose forward re-assigns a buffer (``self.n = self.n + 1``) and uses it."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n = self.n + 1
        return self.l(x) * self.n


@pytest.mark.parametrize("tracer", ["auto", "fx", "export"])
def test_a_buffer_a_submodule_re_assigns_counts_from_the_models_value(tracer):
    """A buffer a submodule's forward re-assigns counts from the model's value on every tracer path: the
    conversion's own runs of the model put the buffer back in its place (they put back values only, and left
    the conversion one step ahead), and torch.export's graph, which drops a submodule's re-assignment
    (non-strict export keeps the root's only), is not used for it. It used to be silently wrong from the
    first call (fx, auto) or the second (export)."""
    model = nn.Sequential(Counted(), nn.Linear(4, 4))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(x,), tracer=tracer)
    assert float(amp.get_submodule("0").n) == 0.0
    for _ in range(3):
        x = torch.randn(2, 4)
        assert rel(amp(x), reference(x)) < 0.03
