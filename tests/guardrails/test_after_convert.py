"""After convert, the converted module is the model: every change a training loop makes to the model or to the
converted module shows through, or the next call raises an ampfx error naming the change and the fix.

One test per kind of change (the crashes and misleading errors are in test_crashes_after_convert.py; the
everyday patterns of the after-convert hunt are replayed by test_after_convert_patterns.py).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import ampfx
from ampfx.errors import ArgumentError, StaleModelError
from conftest import rel

TRACERS = ["auto", "fx", "export"]
X = torch.randn(6, 8)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


# --- 1. parameter order and names -------------------------------------------------------------------------------

class ConvBN(nn.Module):
    """A CNN whose forward uses its modules in another order than it registers them."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.head(self.bn(self.conv(x)).mean((2, 3)))


MODELS = {"encoder_layer": (lambda: nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
                            lambda: torch.randn(2, 5, 16)),
          "conv_bn": (ConvBN, lambda: torch.randn(2, 3, 8, 8))}


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("name", MODELS)
def test_parameters_buffers_and_state_dict_are_the_models_in_its_order(name, tracer):
    """named_parameters(), named_buffers() and state_dict() list the model's own tensors by the model's names
    in the model's order on every capture path (torch.fx registered them in first-use order: an encoder
    layer listed norm1 before linear1)."""
    build, data = MODELS[name]
    model = build()
    amp = ampfx.convert(model, example_inputs=(data(),), tracer=tracer)
    for kind in ("named_parameters", "named_buffers"):
        mine, theirs = list(getattr(amp, kind)()), list(getattr(model, kind)())
        assert [n for n, _ in mine] == [n for n, _ in theirs]
        assert all(a is b for (_, a), (_, b) in zip(mine, theirs))
    assert list(amp.state_dict()) == list(model.state_dict())


def test_code_that_pairs_parameters_by_position_works():
    """parameters_to_vector(amp.parameters()) written back into the model, EMA's update_parameters(amp), and
    an optimizer's state saved from amp's parameters and loaded over the model's all pair by position."""
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, 16)
    amp = ampfx.convert(model, example_inputs=(x,))
    vector = parameters_to_vector(amp.parameters())
    copy_ = copy.deepcopy(model)
    vector_to_parameters(vector, copy_.parameters())
    assert all(torch.equal(a, b) for a, b in zip(copy_.state_dict().values(), model.state_dict().values()))
    ema = torch.optim.swa_utils.AveragedModel(model)
    ema.update_parameters(amp)
    assert all(torch.equal(a, b) for a, b in zip(ema.module.parameters(), model.parameters()))
    opt = torch.optim.Adam(amp.parameters(), lr=1e-3)
    amp(x).float().pow(2).mean().backward()
    opt.step()
    other = torch.optim.Adam(model.parameters(), lr=1e-3)
    other.load_state_dict(opt.state_dict())
    for p in model.parameters():
        assert torch.equal(other.state[p]["exp_avg"], opt.state[p]["exp_avg"])


# --- 2. modes --------------------------------------------------------------------------------------------------

class NormEval(nn.Module):
    """The norm_eval pattern: the model's own train() keeps its batch norm frozen."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.head = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))))

    def train(self, mode: bool = True):
        super().train(mode)
        self.bn.eval()
        return self


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("first", ["train", "eval"])
def test_train_and_eval_run_the_models_own_train(first, tracer):
    """amp.train() / amp.eval() run the model's own train(): after a validation round trip the frozen batch
    norm stays frozen (its statistics do not move in train mode), whichever mode the model was converted in."""
    model = getattr(NormEval(), first)()
    amp = ampfx.convert(model, example_inputs=(X,), tracer=tracer)
    amp.eval()
    amp(X)
    amp.train()
    stats = model.bn.running_mean.clone()
    out = amp(X)
    assert model.training and not model.bn.training and torch.equal(model.bn.running_mean, stats)
    assert rel(out, model(X)) < 0.03


class Noisy(nn.Module):
    """A module whose own Python reads self.training (a graph traced through it holds one mode)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y + 1.0 if self.training else y


@pytest.mark.parametrize("tracer", TRACERS)
def test_a_mode_set_on_one_of_the_models_submodules_is_honoured(tracer):
    """model.bn.eval() (a leaf: the model's own module runs) and model.noisy.eval() (traced through: the graph
    fixed its mode, so the module is converted again) after convert, the rest in train mode."""
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), Noisy(), nn.Linear(8, 2)).train()
    amp = ampfx.convert(model, example_inputs=(X,), tracer=tracer)
    model[1].eval()
    model[2].eval()
    stats = model[1].running_mean.clone()
    out = amp(X)
    assert torch.equal(model[1].running_mean, stats)
    assert rel(out, model(X)) < 0.03


# --- 3. Python values a graph fixed ----------------------------------------------------------------------------

SCALE = 1.0


class Valued(nn.Module):
    """Plain attributes and a global read by a forward that torch.fx and torch.export trace through."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)
        self.temperature, self.flag, self.steps = 1.0, True, 2

    def forward(self, x):
        y = self.norm(self.lin(x)) / self.temperature
        if self.flag:
            y = y * 2
        for _ in range(self.steps):
            y = y + 1
        return y * SCALE


@pytest.mark.parametrize("tracer", TRACERS)
def test_attributes_and_globals_a_graph_fixed_show_through(tracer, monkeypatch):
    """A temperature, a flag in an `if`, a loop count, a norm's eps and a module-level global changed after
    convert: each call computes what the model now computes (the module is converted again where its graph
    held the old value), and changing them back runs the first graph again."""
    model = Valued()
    amp = ampfx.convert(model, example_inputs=(X,), tracer=tracer)
    changes = [("temperature", 4.0), ("flag", False), ("steps", 0), ("eps", 0.5), ("SCALE", 3.0)]
    for name, value in changes:
        if name == "SCALE":
            monkeypatch.setitem(globals(), "SCALE", value)
        else:
            setattr(model.norm if name == "eps" else model, name, value)
        assert rel(amp(X), model(X)) < 0.03, name
    monkeypatch.setitem(globals(), "SCALE", 1.0)
    model.temperature, model.flag, model.steps, model.norm.eps = 1.0, True, 2, 1e-5
    before = len(amp.variants())
    assert rel(amp(X), model(X)) < 0.03 and len(amp.variants()) == before


def test_a_value_that_keeps_changing_raises_at_the_limit_naming_it():
    """A value changed at every call converts again each time, up to reconvert_limit; then the call raises
    StaleModelError naming the value, what the graph held and the fixes (reconvert_limit=0: at once)."""
    model = Valued()
    amp = ampfx.convert(model, example_inputs=(X,), reconvert_limit=2)
    for steps in (3, 4):
        model.steps = steps
        assert rel(amp(X), model(X)) < 0.03
    model.steps = 5
    with pytest.raises(StaleModelError, match=r"model\.steps is 5, the graph was converted with 2.*reconvert_limit"):
        amp(X)
    other = Valued()
    strict = ampfx.convert(other, example_inputs=(X,), reconvert_limit=0)
    other.flag = False
    with pytest.raises(StaleModelError, match=r"model\.flag is False.*leaf_modules"):
        strict(X)


def test_a_conversion_made_again_is_logged_with_the_change(caplog):
    """Converting again costs a conversion: it is logged (logger ampfx.runtime.graph_module, INFO) with what changed."""
    model = Valued()
    amp = ampfx.convert(model, example_inputs=(X,))
    model.flag = False
    with caplog.at_level(logging.INFO, logger="ampfx.runtime.graph_module"):
        amp(X)
    assert "model.flag is False, the graph was converted with True" in caplog.text
    assert "converting it again (1 of at most 8)" in caplog.text
    assert "model.flag is False" in amp.variants()[0].ampfx_report.notes[-1]


# --- 4. hooks added after convert ------------------------------------------------------------------------------

@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("where", ["model_sub", "amp_sub", "model_root", "amp_root"])
def test_hooks_added_after_convert_fire(where, tracer):
    """A forward hook registered after convert on one of the model's modules, on the converted module's,
    on the model itself or on the converted module fires once per call and its result is used."""
    model = mlp()
    amp = ampfx.convert(model, example_inputs=(X,), tracer=tracer)
    target = {"model_sub": lambda: model[0], "amp_sub": lambda: amp.get_submodule("0"),
              "model_root": lambda: model, "amp_root": lambda: amp}[where]()
    ref = copy.deepcopy(model)
    calls = []

    def hook(module, args, out):
        calls.append(1)
        return out * 2 + 1
    target.register_forward_hook(hook)
    (ref[0] if where.endswith("sub") else ref).register_forward_hook(lambda m, a, o: o * 2 + 1)
    amp(X)  # the call that converts again (where a graph traced the module) also runs it while converting
    calls.clear()
    out = amp(X)
    assert len(calls) == 1 and rel(out, ref(X)) < 0.03


def test_full_backward_hook_on_the_model_fires():
    """A full backward hook registered on the model (which the converted graph module stands for) fires."""
    model = mlp()
    amp = ampfx.convert(model, example_inputs=(X,))
    seen = []
    model.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].shape))
    amp(X).sum().backward()
    assert seen == [torch.Size([6, 4])]


# --- 5. structure edits ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tracer", TRACERS)
def test_a_bias_set_to_none_shows_through(tracer):
    """model.fc.bias = None (torch fires no registration hook for it): the graph read the bias, so the module
    is converted again without it."""
    model = mlp()
    amp = ampfx.convert(model, example_inputs=(X,), tracer=tracer)
    model[0].bias = None
    assert rel(amp(X), model(X)) < 0.03


def test_load_state_dict_with_assign_on_the_converted_module_is_the_models():
    """amp.load_state_dict(sd, assign=True) puts the new tensors into the model too (an optimizer over
    model.parameters() trains what amp computes with)."""
    model = mlp()
    amp = ampfx.convert(model, example_inputs=(X,))
    sd = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    amp.load_state_dict(sd, assign=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    assert [id(p) for p in amp.parameters()] == [id(p) for p in model.parameters()]
    assert rel(amp(X), model(X)) < 0.03


def test_moves_and_dtype_changes_of_the_converted_module_are_the_models():
    """amp.double() converts the model's own buffers and parameters (they are one set): the next call
    computes in float64 as the model does; amp.half() under a bfloat16 conversion raises naming the weights."""
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    amp = ampfx.convert(model, example_inputs=(X,))
    amp.double()
    assert model[1].running_mean.dtype == torch.float64 and model[0].weight.dtype == torch.float64
    assert rel(amp(X.double()), model(X.double())) < 1e-6
    amp.float().half()
    with pytest.raises(StaleModelError, match=r"model\.0\.weight \(float16\).*converted to bfloat16.*\.float\(\)"):
        amp(X.half())


def test_converting_a_converted_module_converts_its_model():
    """ampfx.convert(amp) converts the model amp is a view of (with the new options), and says so."""
    model = mlp()
    amp = ampfx.convert(model, example_inputs=(X,))
    again = ampfx.convert(amp, torch.float16, example_inputs=(X,))
    assert again.__dict__["_ampfx_model"] is model
    assert any("converted module" in n for n in again.ampfx_report.notes)
    model[0].weight = nn.Parameter(torch.randn(16, 8))
    assert rel(again(X), model(X)) < 0.03


def test_inference_mode_follows_an_in_place_load():
    """mode='inference' then model.load_state_dict(ckpt): the low copies are made again from the new weights."""
    model = mlp()
    amp = ampfx.convert(model, example_inputs=(X,), mode="inference")
    model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
    assert rel(amp(X), model(X)) < 0.03


# --- 6. Python state set in forward -----------------------------------------------------------------------------

class Attention(nn.Module):
    """Keeps its attention map for visualisation and counts its calls."""

    def __init__(self):
        super().__init__()
        self.qk, self.calls = nn.Linear(8, 8), 0

    def forward(self, x):
        self.calls += 1
        a = self.qk(x).softmax(-1)
        self.attn = a.detach()
        return a


@pytest.mark.parametrize("tracer", TRACERS)
def test_python_state_set_in_forward_lands_on_the_models_modules(tracer):
    """What a forward sets (an attention map, a call counter) is on the model's own module after amp's calls."""
    model = nn.Sequential(nn.Linear(8, 8), Attention(), nn.Linear(8, 2))
    amp = ampfx.convert(model, example_inputs=(X,), tracer=tracer)
    amp(X), amp(X)
    assert model[1].calls == 2 and model[1].attn.shape == (6, 8)


# --- 7. convert() leaves model-owned state alone -----------------------------------------------------------------

class Sampler(nn.Module):
    """Draws from a generator it owns."""

    def __init__(self):
        super().__init__()
        self.lin, self.g = nn.Linear(8, 8), torch.Generator().manual_seed(3)

    def forward(self, x):
        return self.lin(x) + torch.rand(x.shape, generator=self.g)


@pytest.mark.parametrize("tracer", TRACERS)
def test_convert_leaves_a_generator_the_model_owns_alone(tracer):
    """The model's own torch.Generator is where it was after convert() (its runs drew from it)."""
    model = Sampler()
    state = model.g.get_state().clone()
    ampfx.convert(model, example_inputs=(X,), tracer=tracer)
    assert torch.equal(model.g.get_state(), state)


# --- 8. crashes that became working or clear --------------------------------------------------------------------

class Scripted(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.head = torch.jit.script(nn.Linear(8, 8)), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.inner(x))


def test_a_scripted_submodule_is_a_leaf_and_a_scripted_root_is_a_clear_error():
    """A torch.jit.script'ed submodule stays as it is (it takes no hooks: converting raised); a scripted root
    cannot be rewritten: ArgumentError saying to convert the Python model."""
    model = Scripted()
    amp = ampfx.convert(model, example_inputs=(X,))
    assert amp.get_submodule("inner") is model.inner and rel(amp(X), model(X)) < 0.03
    with pytest.raises(ArgumentError, match="TorchScript module.*Convert the Python model"):
        ampfx.convert(torch.jit.script(mlp()), example_inputs=(X,))


# --- what an independent review of the view found, each a test --------------------------------------------------

class Flagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.flag = nn.Linear(8, 8), True

    def forward(self, x):
        y = self.lin(x)
        return y * 2 if self.flag else y


@pytest.mark.parametrize("where", ["root", "block"])
def test_a_conversion_made_again_runs_the_hooks_once(where):
    """A conversion made again at a call runs inside the call of the graph module it stands in for: the model
    module's hooks fire once, not also from the new conversion's own copies of them (an output-changing hook
    was applied twice)."""
    model = nn.Sequential(nn.Linear(8, 8), Flagged(), nn.Linear(8, 4))
    calls = []
    (model if where == "root" else model[1]).register_forward_hook(lambda m, a, o: (calls.append(1), o * 2 + 1)[1])
    ref = copy.deepcopy(model)
    amp = ampfx.convert(model, example_inputs=(X,))
    model[1].flag = ref[1].flag = False
    amp(X)
    calls.clear()
    out = amp(X)
    assert len(calls) == 1 and rel(out, ref(X)) < 0.03


class Masked(nn.Module):
    """Float attributes out of float16's range: an attention mask value and a scale."""

    def __init__(self):
        super().__init__()
        self.lin, self.mask_value, self.big = nn.Linear(8, 8), -1e9, 1e5

    def forward(self, x):
        y = self.lin(x)
        y = y.masked_fill(y < -0.5, self.mask_value).softmax(-1)
        return (y * self.big) / self.big


def test_a_float_the_low_dtype_cannot_hold_stays_a_constant_and_a_lifted_one_stays_in_range():
    """A float attribute float16 cannot hold is not read at call time: it stays a constant the op classes see
    (they keep the op float32), so masked_fill(-1e9) and x * 1e5 under float16 give the model's result; a
    lifted float set out of range later converts again."""
    model = Masked()
    amp = ampfx.convert(model, torch.float16, example_inputs=(X,))
    out = amp(X)
    assert torch.isfinite(out).all() and rel(out, model(X)) < 0.03
    scaled = Valued()
    amp = ampfx.convert(scaled, torch.float16, example_inputs=(X,))
    scaled.temperature = 0.5  # lifted at 1.0; still a float16 number: read at every call
    assert rel(amp(X), scaled(X)) < 0.03 and not amp.variants()
    scaled.temperature = 1e6  # no float16 number: converted again, the division kept float32
    assert rel(amp(X), scaled(X)) < 0.03 and len(amp.variants()) == 1


def test_a_converted_module_saved_after_a_change_converts_again_when_loaded(tmp_path):
    """torch.save of the converted module after a value its graph fixed changed: the loaded copy checks what its
    graph fixed against its own copy of the model and converts again, never the old graph in silence."""
    model = nn.Sequential(nn.Linear(8, 8), Flagged())
    amp = ampfx.convert(model, example_inputs=(X,))
    model[1].flag = False
    torch.save(amp, tmp_path / "amp.pt")
    loaded = torch.load(tmp_path / "amp.pt", weights_only=False)
    assert rel(loaded(X), model(X)) < 0.03
    assert any("model.1.flag" in note for v in loaded.variants() for note in v.ampfx_report.notes)


def test_a_loaded_copy_of_a_model_that_cannot_be_pickled_whole_raises_where_it_cannot_follow(tmp_path):
    """A model holding what pickle refuses (a lambda) is saved without it: the loaded copy is standalone, checks
    what its graph fixed against its own modules and raises (it cannot convert again)."""
    model = nn.Sequential(nn.Linear(8, 8), Flagged())
    model.hook = lambda x: x  # noqa: E731 - pickle refuses it
    amp = ampfx.convert(model, example_inputs=(X,))
    model[1].flag = False
    torch.save(amp, tmp_path / "amp.pt")
    loaded = torch.load(tmp_path / "amp.pt", weights_only=False)
    with pytest.raises(StaleModelError, match=r"model\.1\.flag is False.*loaded from a pickle"):
        loaded(X)


def test_inference_copies_of_a_copied_or_loaded_module_follow_its_weights(tmp_path):
    """mode='inference' low copies of copy.deepcopy(amp) and of a loaded amp are made again when their (copied)
    weights change in place (version counters start anew in a copy)."""
    for make in ("deepcopy", "pickle"):
        amp = ampfx.convert(mlp(), mode="inference")
        if make == "deepcopy":
            other = copy.deepcopy(amp)
        else:
            torch.save(amp, tmp_path / "inf.pt")
            other = torch.load(tmp_path / "inf.pt", weights_only=False)
        other(X)
        with torch.no_grad():
            for p in other.parameters():
                p.mul_(-1)
        plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        plain.load_state_dict(other.state_dict())
        assert rel(other(X), plain(X)) < 0.03, make


def test_eval_reaches_a_module_set_on_the_converted_module():
    """amp.drop = nn.Dropout() set on the converted module (not the model): amp.eval() switches it too."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    amp = ampfx.convert(model, example_inputs=(X,))
    amp.drop = nn.Dropout(0.5)
    amp.eval()
    assert not amp.drop.training and not model.training


CONFIG = type("Config", (), {})()
CONFIG.shift, CONFIG.act = False, torch.relu


class Reads(nn.Module):
    """Values a forward reads that are not its own plain attributes: a class-level default, a field of a config
    object that also holds a function, a field of a module-level object, and an attribute of a leaf child."""

    use_shift = False

    def __init__(self):
        super().__init__()
        self.lin, self.drop, self.cfg = nn.Linear(8, 8), nn.Dropout(0.0), type("Cfg", (), {})()
        self.cfg.shift, self.cfg.act, self.cfg.width, self.cfg.name = False, torch.tanh, 8, "cfg"

    def forward(self, x):
        y = self.drop(self.lin(x))
        if self.use_shift:
            y = y + 1
        if self.cfg.shift:
            y = y + 2
        if CONFIG.shift:
            y = y + 3
        if self.drop.p > 0:
            y = y * 0.5
        return y


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("change", ["class default", "config field", "module-level object", "leaf attribute"])
def test_values_read_elsewhere_than_the_modules_own_attributes_are_checked(change, tracer, monkeypatch):
    """Each of these values decided a branch while tracing; a change after convert is seen."""
    model = Reads().eval()
    amp = ampfx.convert(model, example_inputs=(X,), tracer=tracer)
    if change == "class default":
        model.use_shift = True
    elif change == "config field":
        # a configuration's fields are checked as one term (ampfx.runtime.fixed._grouped)
        assert any(get is not None for *_, get in amp._rt.fixed._groups)
        model.cfg.shift = True
    elif change == "module-level object":
        monkeypatch.setattr(CONFIG, "shift", True)
    else:
        model.drop.p = 0.5
    assert rel(amp(X), model(X)) < 0.03


def helper_noise(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    return y + 1 if module.training else y


class Helped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return helper_noise(self, self.lin(x))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_training_read_by_a_function_the_forward_calls_is_a_mode_the_graph_fixed(tracer):
    """A forward that calls a module-level function reading module.training: eval runs the eval branch."""
    model = Helped()
    amp = ampfx.convert(model, example_inputs=(X,), tracer=tracer)
    amp.eval()
    assert rel(amp(X), model.eval()(X)) < 0.03


def test_constants_a_capture_made_move_with_the_converted_module():
    """torch.export's tensor constants, kept on the graph module (not the model's buffers), move with amp.to()."""
    class Offsets(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) + torch.tensor([1.0, 2.0] * 4, device=x.device)
    model = Offsets()
    amp = ampfx.convert(model, example_inputs=(X,), tracer="export")
    amp.to("meta")
    assert amp(X.to("meta")).device.type == "meta"


def test_a_model_method_using_super_runs_through_the_converted_module():
    """A method of the model's class that calls super() (a reset_parameters override), reached through the graph
    module that stands for it, runs on the model's module (bound to the graph module, super() raised)."""
    class MyLinear(nn.Linear):
        def reset_parameters(self):
            super().reset_parameters()
            if self.bias is not None:
                nn.init.zeros_(self.bias)
    model = MyLinear(8, 8)
    amp = ampfx.convert(model, example_inputs=(X,))
    with torch.no_grad():
        model.bias.fill_(1.0)
    amp.reset_parameters()
    assert torch.equal(model.bias, torch.zeros(8))


class Counted(nn.Module):
    """A counter the training loop bumps (not read by forward)."""

    def __init__(self):
        super().__init__()
        self.lin, self.updates = nn.Linear(8, 8), 0

    def forward(self, x):
        return self.lin(x)

    def on_optimizer_step(self):
        self.updates += 1


def test_bookkeeping_the_forward_does_not_read_converts_nothing_again():
    """An attribute only another method names (a step counter) is not one the graph fixed."""
    model = Counted()
    amp = ampfx.convert(model, example_inputs=(X,), reconvert_limit=0)
    for _ in range(3):
        model.on_optimizer_step()
        amp(X)
    assert not amp.variants()


def test_the_example_inputs_are_not_kept_alive():
    """The converted module holds no reference to convert()'s example inputs."""
    import gc
    import weakref
    x = torch.randn(6, 8)
    ref = weakref.ref(x)
    amp = ampfx.convert(mlp(), example_inputs=(x,))
    del x
    gc.collect()
    assert ref() is None and amp is not None


def test_fixed_values_are_checked_the_same_way_without_the_generated_expression(monkeypatch):
    """A graph with more fixed values than ampfx.runtime.fixed.COMPILED_SLOTS checks them in loops (compiling one
    expression of thousands of terms took seconds): the same changes are seen."""
    from ampfx.runtime import fixed
    monkeypatch.setattr(fixed, "COMPILED_SLOTS", 0)
    model = Valued()
    amp = ampfx.convert(model, example_inputs=(X,), tracer="export")
    assert amp._rt.fixed._values_hold == amp._rt.fixed._loop
    for name, value in [("flag", False), ("steps", 0), ("temperature", 2.0)]:
        setattr(model, name, value)
        assert rel(amp(X), model(X)) < 0.03, name
    model.lin.half()
    with pytest.raises(StaleModelError, match=r"model\.lin\.weight \(float16\)"):
        amp(X)


def test_inference_copies_follow_weights_re_pointed_with_data():
    """mode='inference': a weight re-pointed with ``.data = ...`` (vector_to_parameters does) moves no version
    counter; its storage changed, and its low copy is made again."""
    model = mlp()
    amp = ampfx.convert(model, example_inputs=(X,), mode="inference")
    amp(X)
    vector_to_parameters(parameters_to_vector(model.parameters()) * -1, model.parameters())
    assert rel(amp(X), model(X)) < 0.03


def test_a_fixed_value_of_a_dict_with_a_default_is_checked_a_key_at_a_time():
    """A dict with ``__missing__`` (a ``defaultdict``) would make a deleted key anew, with its default, when its keys
    are read at once: its slots stay terms of their own (``get(key, missing)``), which see the key gone."""
    import collections

    from ampfx.runtime import fixed
    d = collections.defaultdict(int, a=0, b=1)
    assert all(get is None for *_, get in fixed._grouped([(d, "a", 0, ""), (d, "b", 1, "")]))
    plain = {"a": 0, "b": 1}
    assert [get is None for *_, get in fixed._grouped([(plain, "a", 0, ""), (plain, "b", 1, "")])] == [False]
