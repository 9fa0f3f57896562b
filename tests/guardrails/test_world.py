"""convert() leaves the caller's world as it found it (case 6 of issue #17), the converted module
follows the model it was converted from or says it cannot (case 16), and models with lazy modules,
parametrizations, pruning and hooks convert or fail clearly (case 17)."""
from __future__ import annotations

import copy
import gc
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.prune as prune
from torch.nn.modules import module as torch_module
from torch.nn.utils import parametrizations

import ampfx
from ampfx.runtime import follow
from ampfx import state
from ampfx.errors import StaleModelError, UninitializedModelError
from conftest import rel

TRACERS = ["auto", "fx", "export"]


class Meddler(nn.Module):
    """Changes everything it can in forward: buffers (rebound and in place), a parameter in
    place and through .data, plain attributes (counter, cache, list, dict), the global RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("avg", torch.zeros(4))
        self.scale = torch.ones(4)  # a plain tensor attribute
        self.calls, self.cache, self.hist, self.stats = 0, None, [], {"n": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        self.avg.mul_(0.9).add_(x.mean(0).detach())
        self.scale.mul_(1.5)
        self.calls += 1
        self.cache = x.detach()
        self.hist.append(len(self.hist))
        self.stats["n"] += 1
        with torch.no_grad():
            self.lin.weight.mul_(1.01)
            self.lin.bias.data.add_(0.5)
        return self.lin(x) * self.scale + torch.rand(()) * 0


class Untraceable(nn.Module):
    """torch.fx fails on the data-dependent branch: the ladder falls to export and to the
    module's own Python, running it for real."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out, self.drop = Meddler(), nn.Linear(4, 4), nn.Dropout(0.5)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.n, self.seen = 0, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        self.n += 1
        self.seen.append(x.shape[0])
        self.last = x
        if x.sum() > -1e9:
            x = self.inner(x)
        return self.drop(self.out(x))


def world(m: nn.Module) -> tuple:
    """Everything convert() must leave as it was: tensor values, attributes, modes, RNG."""
    tensors = {k: v.clone() for k, v in m.state_dict(keep_vars=True).items()}
    attrs = {n: {k: copy.deepcopy(v) for k, v in mm.__dict__.items() if not k.startswith("_")}
             for n, mm in m.named_modules()}
    return tensors, attrs, torch.get_rng_state().clone()


def same_world(a: tuple, b: tuple) -> list[str]:
    diffs = [f"tensor {k}" for k in a[0] if not torch.equal(a[0][k], b[0][k])]
    for n, attrs in a[1].items():
        for k, v in attrs.items():
            w = b[1][n].get(k, "<missing>")
            eq = torch.equal(v, w) if isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) else v == w
            if not eq:
                diffs.append(f"attribute {n}.{k}: {v!r} -> {w!r}")
        diffs += [f"attribute {n}.{k} added" for k in b[1][n] if k not in attrs]
    if not torch.equal(a[2], b[2]):
        diffs.append("global RNG")
    return diffs


# --- case 6: convert() never changes the caller's world ------------------------------------

@pytest.mark.parametrize("clone_bytes", [0, state.CLONE_BYTES], ids=["copy-on-write", "cloned"])
@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("cls", [Untraceable, Meddler])
def test_convert_leaves_model_and_rng_untouched(cls, training, tracer, clone_bytes, monkeypatch):
    """Every real run during conversion (ladder, shapes, reproduction check, observation) is undone:
    parameters, buffers, attributes set in forward and the global RNG are as before convert(), whether
    the parameters were cloned first (small models) or copied on first write (large ones)."""
    monkeypatch.setattr(state, "CLONE_BYTES", clone_bytes)
    m = cls().train(training)
    x = torch.randn(3, 4)
    before = world(m)
    ampfx.convert(m, torch.bfloat16, example_inputs=(x,), tracer=tracer)
    assert same_world(before, world(m)) == []


def test_converted_module_starts_from_the_models_state():
    """Attributes conversion's runs set (an eager root's counter, cache and list) are put back: the first
    call sees what the model's first call sees, and what that call sets lands on the model's own module
    (the converted module is a view of the model)."""
    m = Untraceable()
    amp = ampfx.convert(m, example_inputs=(torch.randn(3, 4),))
    assert (amp.n, amp.seen, int(amp.steps), hasattr(amp, "last")) == (0, [], 0, False)
    amp(torch.randn(2, 4))
    assert (amp.n, amp.seen, m.n, m.seen) == (1, [2], 1, [2]) and amp.seen is m.seen


def test_calibration_leaves_model_untouched():
    """Calibration runs forward and backward: parameters, their .grad, buffers and RNG are kept."""
    m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 2))
    x, batches = torch.randn(6, 4), [torch.randn(6, 4) for _ in range(2)]
    before = world(m)
    ampfx.convert(m, example_inputs=(x,), calibrate=batches)
    assert same_world(before, world(m)) == []
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_convert_keeps_cuda_rng():
    """The CUDA generator is kept too, for a model on the GPU."""
    m = Untraceable().cuda()
    state = torch.cuda.get_rng_state()
    ampfx.convert(m, example_inputs=(torch.randn(3, 4, device="cuda"),))
    assert torch.equal(state, torch.cuda.get_rng_state())


# --- case 16: the converted module follows the model, or raises ---------------------------

def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


X = torch.randn(5, 4)


@pytest.mark.parametrize("tracer", TRACERS)
def test_replaced_parameter_is_followed(tracer):
    """``model[0].weight = nn.Parameter(...)`` of the same shape: the converted module computes and
    trains the new tensor (relative error was 0.96 before)."""
    m = mlp()
    amp = ampfx.convert(m, example_inputs=(X,), tracer=tracer)
    m[0].weight = nn.Parameter(torch.randn(8, 4))
    assert rel(amp(X), m(X)) < 0.02
    amp(X).sum().backward()
    assert m[0].weight.grad is not None


def test_load_state_dict_assign_is_followed():
    """``load_state_dict(sd, assign=True)`` re-points every tensor; the converted module follows."""
    m = mlp()
    amp = ampfx.convert(m, example_inputs=(X,))
    m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()}, assign=True)
    assert rel(amp(X), m(X)) < 0.02


def test_replaced_buffer_is_followed():
    """A buffer rebound to a tensor of the same shape (BatchNorm statistics) is followed in eval mode."""
    m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)).eval()
    amp = ampfx.convert(m, example_inputs=(X,))
    m[1].running_mean = torch.full((8,), 3.0)
    assert rel(amp(X), m(X)) < 0.02


@pytest.mark.parametrize("change", ["module", "shape", "tied", "added", "parametrization"])
def test_a_structure_change_converts_again_at_the_next_call_or_raises_without_a_limit(change):
    """A swapped submodule, a parameter of another shape, an untied weight, a new parameter, a
    parametrization added: the next call converts the model again (its result is the model's, the
    conversion is in variants() with the change in its notes); with reconvert_limit=0 it raises
    StaleModelError naming the place and the fix."""
    for limit in (None, 0):
        m = mlp()
        if change == "tied":
            m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
            m[2].weight = m[0].weight
        x = torch.randn(5, 4)
        options = {} if limit is None else {"reconvert_limit": limit}
        amp = ampfx.convert(m, example_inputs=(x,), **options)
        amp(x)
        place = {"module": "model.2", "shape": "model.0.weight", "tied": "model.2.weight", "added": "model.0.extra",
                 "parametrization": "model.0.parametrizations"}[change]
        if change == "module":
            m[2] = nn.Linear(m[2].in_features, 2)
        elif change == "shape":
            m[0].weight = nn.Parameter(torch.randn(6, 4))
            m[0].bias = nn.Parameter(torch.randn(6))
            m[2] = nn.Linear(6, m[2].out_features)
        elif change == "tied":
            m[2].weight = nn.Parameter(torch.randn(4, 4))
        elif change == "added":
            m[0].extra = nn.Parameter(torch.ones(1))
        else:
            parametrizations.weight_norm(m[0])
        if limit == 0:
            with pytest.raises(StaleModelError, match=place.replace(".", r"\.")) as e:
                amp(x)
            assert "convert the model again" in str(e.value)
            assert isinstance(e.value, RuntimeError)
            continue
        assert rel(amp(x), m(x)) < 0.02
        assert len(amp.variants()) == 1 and place in amp.variants()[0].ampfx_report.notes[-1]
        amp(x).sum().backward()  # it trains: the model's parameters get gradients
        assert all(p.grad is not None for n, p in m.named_parameters() if n != "0.extra")
        assert len(amp.variants()) == 1  # made once, reused


def test_inplace_updates_need_nothing():
    """Optimizer steps, .data and the default load_state_dict stay shared and raise nothing."""
    m = mlp()
    amp = ampfx.convert(m, example_inputs=(X,))
    opt = torch.optim.SGD(amp.parameters(), lr=0.1)
    amp(X).sum().backward()
    opt.step()
    m.load_state_dict({k: v * 2 for k, v in m.state_dict().items()})
    m[0].bias.data.fill_(1.0)
    assert rel(amp(X), m(X)) < 0.02


@pytest.mark.parametrize("tracer", TRACERS)
def test_mode_follows_model(tracer):
    """``model.eval()`` after convert switches the converted module too (dropout off, batch-norm
    statistics untouched); ``model.train()`` switches it back."""
    m = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.BatchNorm1d(8))
    amp = ampfx.convert(m, example_inputs=(X,), tracer=tracer)
    m.eval()
    stats = m[2].running_mean.clone()
    out = amp(X)
    assert not amp.training and torch.equal(m[2].running_mean, stats)
    assert rel(out, m(X)) < 0.02
    m.train()
    amp(X)
    assert amp.training and not torch.equal(m[2].running_mean, stats)


def test_the_mode_of_the_converted_module_is_the_models():
    """``amp.eval()`` runs the model's own ``eval()`` (the converted module is a view of the model); a
    later ``model.train()`` is what both are in."""
    m = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5))
    amp = ampfx.convert(m, example_inputs=(X,))
    amp.eval()
    assert not m.training and not m[1].training and not amp.training
    assert torch.equal(amp(X), amp(X))  # dropout off
    m.train()
    assert amp.training and not torch.equal(amp(X), amp(X))
    amp.train()
    m[1].eval()  # one submodule of the model: honoured
    assert torch.equal(amp(X), amp(X))


def test_eager_root_follows_too():
    """A model whose root keeps its Python (untraceable) follows replaced parameters and mode."""
    m = Untraceable()
    amp = ampfx.convert(m, example_inputs=(X,))
    m.eval()
    amp(X)
    assert not amp.training
    m.out = nn.Linear(4, 4)
    with pytest.raises(StaleModelError, match=r"model\.out"):
        amp(X)


def test_copies_follow_nothing():
    """deepcopy and pickle of the converted module work; the copy holds its own tensors and follows
    nothing (no error after the model changes, its mode is its own)."""
    m = mlp()
    amp = ampfx.convert(m, example_inputs=(X,))
    dup = copy.deepcopy(amp)
    buf = io.BytesIO()
    torch.save(amp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    m[2] = nn.Linear(8, 2)
    m.eval()
    for c in (dup, loaded):
        assert torch.equal(c(X), c(X)) and c.training
    assert rel(amp(X), m(X)) < 0.02 and len(amp.variants()) == 1  # the original follows: converted again
    pickle.loads(pickle.dumps(copy.deepcopy(amp)))


def test_convert_twice_both_follow():
    """Two conversions of one model both follow it."""
    m = mlp()
    a, b = ampfx.convert(m, example_inputs=(X,)), ampfx.convert(m, torch.float16, example_inputs=(X,))
    m[0].weight = nn.Parameter(torch.randn(8, 4))
    assert rel(a(X), m(X)) < 0.02 and rel(b(X), m(X)) < 0.02


def test_inference_mode_follows_replaced_and_reloaded_parameters():
    """mode='inference' reads low copies of the weights, made again when a master changes: a replaced
    parameter, an in-place load and an optimizer step all show through."""
    m = mlp()
    amp = ampfx.convert(m, example_inputs=(X,), mode="inference")
    m[0].weight = nn.Parameter(torch.randn(8, 4))
    assert rel(amp(X), m(X)) < 0.02
    m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()})
    assert rel(amp(X), m(X)) < 0.02
    torch.optim.SGD(m.parameters(), lr=0.5).zero_grad()
    m(X).sum().backward()
    torch.optim.SGD(m.parameters(), lr=0.5).step()
    assert rel(amp(X), m(X)) < 0.02


def test_hooks_released_when_converted_modules_die():
    """The global registration hooks live only while a converted module does. The converted module is a
    view of the model and keeps it alive (as torch.compile's OptimizedModule does); nothing keeps the
    converted module alive, and once it is gone the model is released too."""
    gc.collect()
    base = len(torch_module._global_parameter_registration_hooks)
    m = mlp()
    amp = ampfx.convert(m, example_inputs=(X,))
    assert len(torch_module._global_parameter_registration_hooks) == base + (follow._LIVE[0] == 1)
    model_ref, amp_ref = __import__("weakref").ref(m), __import__("weakref").ref(amp)
    del m
    gc.collect()
    assert model_ref() is not None and amp_ref() is not None
    amp(X)
    del amp
    gc.collect()
    assert amp_ref() is None and model_ref() is None
    if follow._LIVE[0] == 0:  # no other converted module alive in this process
        assert not follow._HANDLES and len(torch_module._global_parameter_registration_hooks) == base - bool(base)


# --- case 17: lazy modules, parametrizations, pruning, hooks --------------------------------

@pytest.mark.parametrize("lazy", [lambda: nn.LazyLinear(8), lambda: nn.LazyConv2d(4, 3)])
def test_uninitialised_lazy_module_is_a_clear_error(lazy):
    """Uninitialised lazy parameters: an UninitializedModelError saying to run the model once
    (convert never changes the model); after that dry run the model converts."""
    m = nn.Sequential(lazy(), nn.ReLU())
    x = torch.randn(2, 3, 8, 8) if isinstance(m[0], nn.LazyConv2d) else torch.randn(5, 4)
    with pytest.raises(UninitializedModelError, match=r"Run the model once"):
        ampfx.convert(m, example_inputs=(x,))
    m(x)
    amp = ampfx.convert(m, example_inputs=(x,))
    assert rel(amp(x), m(x)) < 0.02


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("where", ["root", "child"])
def test_forward_hooks_are_kept(tracer, where):
    """Forward hooks and pre-hooks run in the converted module, on the root too (torch.fx traces
    forward alone: a dropped root hook was a silent wrong answer), also in a deep copy."""
    m = mlp()
    target = m if where == "root" else m[2]
    target.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    target.register_forward_hook(lambda mod, args, out: out * 3 + 1)
    x = torch.randn(5, 4) if where == "root" else X
    amp = ampfx.convert(m, example_inputs=(x,), tracer=tracer)
    assert rel(amp(x), m(x)) < 0.02
    assert rel(copy.deepcopy(amp)(x), m(x)) < 0.02


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("kind", ["weight_norm", "old_weight_norm", "prune"])
def test_parametrized_and_pruned_modules_convert(tracer, kind):
    """weight_norm (both APIs) and pruning: right values, and gradients reach the parametrization's
    own parameters."""
    m = mlp()
    if kind == "weight_norm":
        parametrizations.weight_norm(m[0])
    elif kind == "old_weight_norm":
        with pytest.warns(FutureWarning):
            nn.utils.weight_norm(m[0])
    else:
        prune.l1_unstructured(m[0], "weight", 0.5)
    amp = ampfx.convert(m, example_inputs=(X,), tracer=tracer)
    assert rel(amp(X), m(X)) < 0.02
    amp(X).sum().backward()
    assert all(p.grad is not None for p in m[0].parameters())


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("kind", ["spectral_norm", "orthogonal"])
def test_parametrizations_run_in_float32_with_their_buffers(tracer, kind):
    """spectral_norm / orthogonal (torch.nn.utils.parametrizations) on a module run as a low-precision
    leaf: the parametrization computes the weight in float32, as in the model (its power-iteration
    buffers update as the model's do; under export the graph holds the iteration), and only the result is cast (casting its ``original`` made
    ``addmv`` / ``mm`` fail on mixed dtypes); gradients reach the original weight."""
    torch.manual_seed(0)
    m = mlp()
    (parametrizations.spectral_norm if kind == "spectral_norm" else parametrizations.orthogonal)(m[0])
    twin = copy.deepcopy(m)
    amp = ampfx.convert(m, example_inputs=(X,), tracer=tracer)
    assert rel(amp(X), twin(X)) < 0.03
    for name, buf in twin[0].named_buffers():  # updated as the model updates them (export's graph
        # runs the power iteration's matrix-vector products in the low dtype, as autocast would)
        assert torch.allclose(dict(m[0].named_buffers())[name], buf, atol=0.02), name
    amp(X).sum().backward()
    assert m[0].parametrizations.weight.original.grad is not None


def test_parameters_left_as_they_were_keep_their_version_counter():
    """Putting back only what changed: an unchanged parameter is not rewritten, so an autograd graph
    the caller built before convert() still runs backward afterwards."""
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    loss = net(torch.randn(3, 4)).sum()
    versions = [p._version for p in net.parameters()]
    ampfx.convert(net, torch.bfloat16, example_inputs=(torch.randn(3, 4),))
    assert [p._version for p in net.parameters()] == versions
    loss.backward()


SEEN_THREADS: list[int] = []


class ThreadSpy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN_THREADS.append(torch.get_num_threads())
        return self.lin(x)


@pytest.mark.parametrize("clone_bytes, inside", [(state.CLONE_BYTES, 1), (0, 2)], ids=["small", "large"])
def test_conversion_runs_a_small_cpu_model_on_one_thread_and_gives_the_threads_back(clone_bytes, inside, monkeypatch):
    """A loaded machine makes tiny ops on two threads 50x slower; the caller's setting comes back."""
    monkeypatch.setattr(state, "CLONE_BYTES", clone_bytes)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        SEEN_THREADS.clear()
        ampfx.convert(ThreadSpy(), torch.bfloat16, example_inputs=(torch.randn(3, 4),))
        assert SEEN_THREADS and set(SEEN_THREADS) == {inside}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
