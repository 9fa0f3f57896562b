"""Training modes and region boundaries (issue #17, cases 10-13 and their neighbours).

- ``.train()`` / ``.eval()`` on a converted module run what converting the model in that mode makes
  (the same capture ladder, verification and regions), never a graph that froze a random branch;
- a region's float inputs are cast to what its graph expects, whatever the eager parent hands it;
- a converted module keeps the attributes and methods code around it reads.
"""
import copy
import pickle
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx.errors import TrainingModeError
from ampfx.runtime.graph_module import AmpGraphModule, ModeUnavailable
from conftest import rel_err


def distinct(module, x, n=30):
    with torch.no_grad():
        return len({tuple(module(x).flatten().tolist()) for _ in range(n)})


class LayerDrop(nn.Module):
    """wav2vec2's layerdrop: a random draw in Python decides which layers run in training."""

    def __init__(self, n=6, p=0.5):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
        self.p = p

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand(()) < self.p:
                continue
            x = x + layer(x)
        return x


class PyLayerDrop(LayerDrop):
    """fairseq's layerdrop: the draw comes from Python's random module, which no tracer sees."""

    def forward(self, x):
        for layer in self.layers:
            if self.training and random.random() < self.p:
                continue
            x = x + layer(x)
        return x


class MaskedInTraining(nn.Module):
    """Data-dependent masking in training only: torch.export fails in train mode, not in eval."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc1(x)
        if self.training and (h > 3).any():
            h = h.clamp(max=3)
        return self.fc2(F.dropout(h, 0.1, self.training))


class BranchInEval(nn.Module):
    """Captures in train mode; in eval mode a branch on values stops torch.fx and torch.export."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        h = self.bn(self.fc(x))
        h = F.dropout(h, 0.2, self.training)
        if not self.training and h.sum() > 0:
            h = h * 2
        return h


def test_layerdrop_converted_in_eval_then_trained_draws_its_layers_as_eager_does():
    """Case 13: converted in eval mode, then .train(): the layers are drawn on each call (the fx graph of
    the train-mode Python froze one draw; it is no longer used), eval stays deterministic."""
    torch.manual_seed(0)
    m, x = LayerDrop().eval(), torch.randn(3, 8)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,))
    assert distinct(amp.train(), x) > 4
    assert distinct(m.train(), x) > 4
    amp.eval()
    assert distinct(amp, x) == 1
    assert rel_err(amp(x), m.eval()(x)) < 0.03


def test_the_train_mode_conversion_is_the_one_convert_makes_in_train_mode():
    """Case 12/13: the module run after .train() was made as ampfx.convert(model.train()) makes it: the
    same regions with the same methods; the report says what each mode runs."""
    m, x = LayerDrop().eval(), torch.randn(3, 8)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,))
    direct = ampfx.convert(LayerDrop().train(), "bf16", example_inputs=(x,))
    train = amp.mode_module(True)
    assert train is not amp and amp.mode_module(False) is amp
    assert [(r.path, r.method) for r in train.ampfx_report.parts] == \
        [(r.path, r.method) for r in direct.ampfx_report.parts]
    assert any(r.path == "" and "eager" in r.method for r in train.ampfx_report.parts)
    note = next(n for n in amp.ampfx_report.notes if "in train mode the module runs a second conversion" in n)
    assert "when first needed" in note and ".mode_module(True).ampfx_report" in note
    assert ("layers.0", "fx") in [(r.path, r.method) for r in train.ampfx_report.parts]


@pytest.mark.parametrize("cls", [LayerDrop, PyLayerDrop])
def test_a_random_branch_in_python_is_never_frozen_into_a_graph(cls):
    """Case 13: converting model.train() directly: a draw made while tracing (torch's or Python's random)
    rejects the graph, whatever the draw was; the root keeps its Python and the report says why."""
    m, x = cls().train(), torch.randn(3, 8)
    for seed in range(3):  # whatever the draw at trace time
        torch.manual_seed(seed)
        random.seed(seed)
        amp = ampfx.convert(m, "bf16", example_inputs=(x,))
        root = next(r for r in amp.ampfx_report.parts if r.path == "")
        assert "eager" in root.method
        assert any("drew a random number" in s for s in root.steps), root.steps
        assert distinct(amp, x) > 4


def test_converting_draws_nothing_from_the_callers_random_generators():
    """Rejecting a capture that drew puts torch's and Python's random state back."""
    m, x = PyLayerDrop().train(), torch.randn(3, 8)
    torch.manual_seed(1)
    random.seed(1)
    ampfx.convert(m, "bf16", example_inputs=(x,))
    after = (torch.rand(3), random.random())
    torch.manual_seed(1)
    random.seed(1)
    assert torch.equal(after[0], torch.rand(3)) and after[1] == random.random()


def test_a_mode_that_does_not_export_falls_down_the_same_ladder():
    """Case 12: converted in eval mode with tracer='export'; torch.export fails in train mode. .train()
    runs what converting model.train() makes (the root keeps its Python) and a training step works."""
    torch.manual_seed(0)
    m, x = MaskedInTraining().eval(), torch.randn(4, 8) * 4
    amp = ampfx.convert(m, "bf16", example_inputs=(x,), tracer="export")
    assert amp.ampfx_report.parts[0].method == "export"
    amp.train()
    out = amp(x)
    out.float().pow(2).mean().backward()
    assert m.fc1.weight.grad is not None and torch.isfinite(m.fc1.weight.grad).all()
    assert any("eager" in r.method for r in amp.mode_module(True).ampfx_report.parts)
    amp.eval()
    assert rel_err(amp(x), m.eval()(x)) < 0.03


def test_converted_in_train_then_eval_when_eval_does_not_capture():
    """Neighbour: the train graph captures, the eval Python does not (a branch on values): .eval() runs the
    eval-mode conversion (root eager), right on both sides of the branch; batch-norm uses running stats."""
    torch.manual_seed(0)
    m, x = BranchInEval().train(), torch.randn(6, 8)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,))
    amp(x)  # a training step's forward updates the shared running statistics
    amp.eval()
    m.eval()
    for sign in (1, -1):
        assert rel_err(amp(sign * x), m(sign * x)) < 0.05
    assert distinct(amp, x) == 1


def test_both_modes_share_parameters_buffers_and_follow_reassignment():
    """The two modes' conversions hold the same tensors: batch-norm statistics updated in train mode are
    the eval mode's, and a buffer reassigned on the converted module is the one the other mode reads."""
    torch.manual_seed(0)
    m, x = BranchInEval().train(), torch.randn(6, 8)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,))
    evals = amp.mode_module(False)
    assert evals is not amp and any("eager" in r.method for r in evals.ampfx_report.parts)
    amp(x)
    assert int(m.bn.num_batches_tracked) == 1
    assert evals.bn.running_mean is m.bn.running_mean
    amp.bn.running_mean = torch.full((8,), 5.0)
    out = amp.eval()(x)
    assert evals.bn.running_mean is amp.bn.running_mean
    m.eval().bn.running_mean = amp.bn.running_mean
    assert rel_err(out, m(x)) < 0.05
    assert sorted(amp.state_dict()) == sorted(m.state_dict())
    assert {id(p) for p in evals.parameters()} == {id(p) for p in m.parameters()}


def test_train_and_eval_put_every_module_that_runs_in_that_mode():
    m, x = LayerDrop().eval(), torch.randn(3, 8)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,))
    amp.train()(x)
    assert all(mod.training for mod in amp.mode_module(True).modules())
    amp.eval()(x)
    assert not any(mod.training for mod in amp.modules())


def test_deepcopy_and_pickle_keep_both_modes():
    """deepcopy / pickle keep the other mode's conversion, sharing the copy's own tensors."""
    torch.manual_seed(0)
    m, x = LayerDrop().eval(), torch.randn(3, 8)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,))
    want = amp(x)
    for other in (copy.deepcopy(amp), pickle.loads(pickle.dumps(amp))):
        assert torch.equal(other.eval()(x), want)
        assert distinct(other.train(), x) > 4
        assert sorted(other.state_dict()) == sorted(m.state_dict())
        params = {id(p) for p in other.parameters()}
        assert {id(p) for p in other.mode_module(True).parameters()} == params
        assert not params & {id(p) for p in m.parameters()}


def test_a_graph_that_does_not_depend_on_the_mode_is_converted_once():
    """No second conversion (no convert time spent) where the graph calls its mode-dependent modules
    (nn.Dropout, nn.BatchNorm1d stay calls that follow their own flag)."""
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,))
    assert amp.mode_module(False) is amp and amp.mode_module(True) is amp
    amp.eval()
    assert distinct(amp, x) == 1 and rel_err(amp(x), m.eval()(x)) < 0.03


class Inner(nn.Module):
    """Python fx cannot trace (a branch on values); its children are converted."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) if h.sum() > 0 else self.b(-h)


class WithRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.head = Inner(), nn.Linear(8, 8)

    def forward(self, x):
        return self.head(F.dropout(self.inner(x), 0.3, self.training))


def test_regions_inside_regions_switch_with_their_parent():
    """Neighbour: a graph (reading self.training) with a leaf that keeps its Python and has converted
    children: both modes are right and the other mode's regions are its own."""
    torch.manual_seed(0)
    m, x = WithRegion().eval(), torch.randn(4, 8)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,), tracer="fx")
    assert rel_err(amp(x), m(x)) < 0.03
    assert distinct(amp.train(), x) > 4
    train = amp.mode_module(True)
    assert isinstance(train, AmpGraphModule) and isinstance(train.inner.a, AmpGraphModule)
    assert train.inner.a is not amp.inner.a and train.inner.a.weight is amp.inner.a.weight


class Doubles(nn.Module):
    """Reads self.training: each mode gets its own conversion."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h * 2 if self.training else h


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("start", [True, False])
def test_the_models_own_hooks_run_once_in_either_mode(tracer, start):
    """A forward hook and pre-hook on the converted module run once per call in both modes: the other
    mode's conversion runs inside the converted module's call, whose hooks have already run (under
    torch.fx they ran twice in the other mode: the input tripled twice, +1 added twice)."""
    torch.manual_seed(0)
    m, x = Doubles().train(start), torch.randn(4, 8)
    m.register_forward_pre_hook(lambda mod, args: (args[0] * 3,))
    m.register_forward_hook(lambda mod, args, out: out + 1)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,), tracer=tracer)
    assert amp.mode_module(not start) is not amp
    for training in (start, not start):
        amp.train(training), m.train(training)
        assert rel_err(amp(x), m(x)) < 0.03


def test_a_failed_other_mode_conversion_raises_an_ampfx_error_with_the_fix():
    stand_in = ModeUnavailable(True, "ValueError: bad")
    with pytest.raises(TrainingModeError, match=r"no train-mode conversion.*ampfx.convert\(model.train\(\)"):
        stand_in(torch.ones(1))
    assert issubclass(TrainingModeError, RuntimeError)


# ------------------------------------------------------------------ region boundaries
class Speech(nn.Module):
    """A speech encoder whose eager Python reads its converted children's attributes and methods."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(4, 8, 3, stride=2, padding=1)
        self.proj = Proj()

    def forward(self, x, lengths):
        if (lengths <= 0).any():  # a branch on values: the root keeps its Python
            raise ValueError("empty input")
        h = self.conv1(x)
        out_len = (lengths + 2 * self.conv1.padding[0] - self.conv1.kernel_size[0]) // self.conv1.stride[0] + 1
        return self.proj(h.transpose(1, 2)) * self.proj.scale_for(h), out_len, self.conv1.in_channels


class Proj(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gain = 0.5

    def forward(self, h):
        return self.fc(h) * self.gain

    def scale_for(self, h):
        return self.gain * 2


def test_converted_children_keep_the_attributes_and_methods_their_parent_reads():
    """Case 11: `self.conv1.stride[0]`, `in_channels`, a plain attribute and a method of a converted
    child still work; the converted children are graph modules; deepcopy and pickle keep them."""
    m, x, lengths = Speech(), torch.randn(2, 4, 16), torch.tensor([16, 11])
    amp = ampfx.convert(m, "bf16", example_inputs=(x, lengths))
    assert isinstance(amp.conv1, AmpGraphModule) and isinstance(amp.proj, AmpGraphModule)
    assert amp.conv1.stride == (2,) and amp.conv1.weight is m.conv1.weight and amp.proj.gain == 0.5
    for model in (amp, copy.deepcopy(amp), pickle.loads(pickle.dumps(amp))):
        out, out_len, channels = model(x, lengths)
        want, want_len, _ = m(x, lengths)
        assert torch.equal(out_len, want_len) and channels == 4
        assert rel_err(out, want) < 0.03


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, h):
        return h + self.fc(self.ln(h))


class Decoder(nn.Module):
    """Reads the tied embedding weight for its output projection; keyword-only mask and ids."""

    def __init__(self, shared, d):
        super().__init__()
        self.shared, self.block = shared, Block(d)

    def forward(self, h, *, ids, keep):
        h = (self.block(h) + self.shared(ids)) * keep.unsqueeze(-1)
        return F.linear(h, self.shared.weight)


class EncDec(nn.Module):
    """An encoder-decoder LM with tied embeddings whose root keeps its Python (converted region by region)."""

    def __init__(self, v=40, d=16):
        super().__init__()
        self.shared = nn.Embedding(v, d)
        self.enc = Block(d)
        self.decoder = Decoder(self.shared, d)
        self.pre = nn.Linear(d, d)

    def forward(self, ids, dec_ids):
        if (ids < 0).any():
            raise ValueError("negative id")
        enc = self.enc(self.shared(ids)).mean(1, keepdim=True)
        return self.decoder(self.pre(enc), ids=dec_ids, keep=dec_ids > 0)


def _encdec():
    torch.manual_seed(0)
    return EncDec().train(), torch.randint(1, 40, (2, 7)), torch.randint(0, 40, (2, 5))


@pytest.mark.parametrize("fp32", [(), ("decoder",)])
def test_a_region_casts_its_inputs_to_what_its_graph_expects(fp32):
    """Case 10: a region handed activations in a dtype other than the one it was converted for computes
    (its tied-weight linear, kept float32 by fp32_modules, met a bfloat16 activation: `mat1 and mat2 must
    have the same dtype`); a training step through the whole model works."""
    m, ids, dec = _encdec()
    amp = ampfx.convert(m, "bf16", example_inputs=(ids, dec), fp32_modules=fp32)
    region = amp.decoder
    assert isinstance(region, AmpGraphModule)
    h = torch.randn(2, 1, 16).bfloat16()
    want = m.decoder(h.float(), ids=dec, keep=dec > 0)
    got = region(h, ids=dec, keep=dec > 0)
    assert got.dtype == torch.float32 and rel_err(got, want) < 0.05
    F.cross_entropy(amp(ids, dec).flatten(0, 1), dec.flatten()).backward()
    assert m.shared.weight.grad is not None


def test_integer_and_bool_inputs_at_region_boundaries_are_not_cast():
    """Neighbour: only float inputs get a boundary cast; keyword-only ids (int64) and mask (bool) arrive
    as they are (an embedding needs integer ids), and the report names each boundary cast."""
    m, ids, dec = _encdec()
    amp = ampfx.convert(m, "bf16", example_inputs=(ids, dec))
    boundary = [c for c in amp.ampfx_report.casts if c.source == "as handed"]
    assert boundary and {c.value for c in boundary if c.node.startswith("h")} <= {"h"}
    assert not any(c.value in ("ids", "keep") for c in boundary)
    # both arrive float32: the root's Python gets pre's output in the model's dtype (hand_low is off by default)
    assert [c.to for c in boundary] == [torch.float32, torch.float32]


def test_a_training_step_through_regions_under_user_autocast():
    """Neighbour: a parent running under the user's autocast hands bfloat16 activations to regions
    converted for float32: the step runs and every parameter gets a finite gradient, as eager's do."""
    m, ids, dec = _encdec()
    amp = ampfx.convert(m, "bf16", example_inputs=(ids, dec))
    with torch.autocast("cpu", torch.bfloat16):
        loss = F.cross_entropy(amp(ids, dec).float().flatten(0, 1), dec.flatten())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


class ScaledLayerDrop(LayerDrop):
    """A layerdrop model with a Python int argument: torch.export bakes ``n`` into the eval graph."""

    def forward(self, x, n):
        for layer in self.layers:
            if self.training and torch.rand(()) < self.p:
                continue
            x = x + layer(x)
        return x * n


def test_the_other_modes_call_is_checked_by_that_modes_conversion_alone():
    """Converted in eval mode by export (``n=1`` baked, guarded), then ``.train()``: the train mode
    keeps the model's Python, which takes any ``n``; the eval graph's guard must not refuse that
    call. Back in eval mode, ``n=2`` is refused by the eval graph's guard (with reconvert_limit=0; by default it
    converts again for 2), not computed with 1."""
    torch.manual_seed(0)
    m, x = ScaledLayerDrop().eval(), torch.randn(3, 8)
    again = ampfx.convert(m, "bf16", example_inputs=(x, 1), tracer="export")
    assert rel_err(again(x, 2), m.eval()(x, 2)) < 0.03
    amp = ampfx.convert(m, "bf16", example_inputs=(x, 1), tracer="export", reconvert_limit=0)
    amp.train()
    assert amp(x, 2).shape == x.shape
    amp.eval()
    with pytest.raises(ampfx.errors.GuardError, match="n"):
        amp(x, 2)
    assert rel_err(amp(x, 1), m.eval()(x, 1)) < 0.03
