"""Everyday things a training loop does after ``ampfx.convert``: one probe each (the after-convert hunt).

Each probe builds a tiny model, converts it, makes one change (to the model or to the
converted module ``amp``), calls ``amp`` and classifies the outcome:

  shows           amp computes what the model now computes (rel. error < TOL), gradients /
                  buffers / Python state land where the model's own call puts them
  raises-clear    an exception from ampfx (class defined in a module under ``ampfx``)
  raises-unclear  any other exception (type + first 200 characters)
  SILENT-WRONG    runs, but differs from what the model computes / what a user expects
  harness-error   the probe itself is broken (the float32 model failed before/without ampfx)

tests/guardrails/test_after_convert_patterns.py runs every probe and checks its outcome. Run it on its own
to print the table (a hunt for new patterns starts by adding a probe here):

      python tests/guardrails/after_convert_patterns.py [--filter SUBSTRING|CATEGORY] [--tb] [--identity]
      --tb        print the traceback of every exception
      --identity  self-check of the harness: "convert" returns the model itself; every probe must show

Probe names carry the tracer: ``name`` is tracer="auto", ``name[fx]`` / ``name[export]`` the others.
"""
from __future__ import annotations

import argparse
import copy
import io
import pickle
import random
import signal
import time
import traceback
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx

TOL = 0.05          # relative error allowed for bf16
BF16 = torch.bfloat16


# ----------------------------------------------------------------------------- plumbing

class Wrong(Exception):
    """Raised by a probe: the call ran but the result is not what the model computes."""


class HarnessError(Exception):
    """Raised when the float32 reference itself fails: the probe is broken, not ampfx."""


STATE = {"phase": "setup", "identity": False}   # phase: setup -> convert -> after


def conv(model, example, tracer="auto", **kw):
    """ampfx.convert with example inputs (a tensor or a tuple)."""
    if not isinstance(example, tuple):
        example = (example,)
    STATE["phase"] = "convert"
    if STATE["identity"]:          # --identity: "convert" returns the model itself (checks the probes)
        amp = model
    else:
        amp = ampfx.convert(model, BF16, example_inputs=example, tracer=tracer, **kw)
    STATE["phase"] = "after"
    return amp


def ref(fn):
    """Run a float32 reference computation; its failure is a harness bug."""
    phase = STATE["phase"]
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        raise HarnessError(f"reference failed: {type(e).__name__}: {e}") from e
    finally:
        STATE["phase"] = phase


def rel(a, b):
    a = a.detach().double()
    b = b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    if a.is_complex() or b.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    return ((a - b).norm() / (b.norm() + 1e-6)).item()


def close(got, want, what="output", tol=TOL, dtype=True):
    """Raise Wrong unless got ~= want (and, with dtype=True, of the same dtype)."""
    if isinstance(got, (tuple, list)):
        for i, (g, w) in enumerate(zip(got, want)):
            close(g, w, f"{what}[{i}]", tol, dtype)
        return
    if not torch.is_tensor(got):
        raise Wrong(f"{what}: got {type(got).__name__}, expected a tensor")
    if got.shape != want.shape:
        raise Wrong(f"{what}: shape {tuple(got.shape)} != expected {tuple(want.shape)}")
    if dtype and got.dtype != want.dtype:
        raise Wrong(f"{what}: dtype {got.dtype} != the model's {want.dtype}")
    r = rel(got, want)
    if not r < tol:
        raise Wrong(f"{what}: rel err {r:.3g} (>= {tol})")
    return r


def check(cond, msg):
    if not cond:
        raise Wrong(msg)


def grads_close(model_a, model_b, what="grad", tol=TOL):
    """Gradients of model_a's parameters equal model_b's (by name)."""
    pb = dict(model_b.named_parameters())
    total = sum(q.grad.double().norm() ** 2 for q in pb.values() if q.grad is not None) ** 0.5
    floor = 1e-3 * float(total) if torch.is_tensor(total) else 0.0
    for n, p in model_a.named_parameters():
        q = pb[n]
        if (p.grad is None) != (q.grad is None):
            raise Wrong(f"{what} {n}: {'none' if p.grad is None else 'set'} vs expected "
                        f"{'none' if q.grad is None else 'set'}")
        if p.grad is not None:
            err = (p.grad.double() - q.grad.double()).norm().item()
            if not err <= tol * (q.grad.double().norm().item() + floor):
                raise Wrong(f"{what} {n}: rel err {err / (q.grad.double().norm().item() + 1e-12):.3g} "
                            f"(|grad| {q.grad.norm():.3g}, model total {float(total):.3g})")


def buffers_close(model_a, model_b, what="buffer", tol=1e-2):
    bb = dict(model_b.named_buffers())
    for n, b in model_a.named_buffers():
        if b.dtype.is_floating_point:
            close(b, bb[n], f"{what} {n}", tol)
        else:
            check(torch.equal(b, bb[n]), f"{what} {n}: {b.tolist()} != {bb[n].tolist()}")


def names_match(model, amp):
    """named_parameters / named_buffers / state_dict of amp mirror the model's, same order and same tensors."""
    for kind in ("named_parameters", "named_buffers"):
        m = list(getattr(model, kind)())
        a = list(getattr(amp, kind)())
        mn, an = [n for n, _ in m], [n for n, _ in a]
        if mn != an:
            i = next((i for i, (u, v) in enumerate(zip(mn, an)) if u != v), min(len(mn), len(an)))
            raise Wrong(f"{kind} order/names differ (model {len(mn)}, amp {len(an)}): first at #{i}: "
                        f"model {mn[i:i + 3]} vs amp {an[i:i + 3]}")
        for (n, t), (_, u) in zip(m, a):
            check(t is u, f"{kind} {n}: amp holds another tensor than the model")
    sm, sa = model.state_dict(), amp.state_dict()
    check(list(sm) == list(sa), f"state_dict keys differ: model {list(sm)} vs amp {list(sa)}")
    for k in sm:
        check(sm[k].data_ptr() == sa[k].data_ptr(), f"state_dict[{k}] is not the model's storage")
    return f"{len(list(model.parameters()))} params, {len(list(model.buffers()))} buffers, {len(sm)} state_dict keys match"


# ----------------------------------------------------------------------------- registry

PROBES = []   # (name, category, fn, tracer)
ALL3 = ("auto", "fx", "export")


def probe(category, tracers=("auto",)):
    def deco(fn):
        base = fn.__name__[2:] if fn.__name__.startswith("p_") else fn.__name__
        for t in tracers:
            name = base if t == "auto" else f"{base}[{t}]"
            PROBES.append((name, category, fn, t))
        return fn
    return deco


# ----------------------------------------------------------------------------- tiny models

def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def xin(b=4):
    return torch.randn(b, 8)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(x.mean((2, 3)))


def cnn_x(b=4):
    return torch.randn(b, 3, 8, 8)


def seasoned(cnn):
    """Give BatchNorm non-trivial running stats so eval vs train differ visibly."""
    with torch.no_grad():
        cnn.bn.running_mean.normal_()
        cnn.bn.running_var.uniform_(0.5, 2.0)
        cnn.bn.weight.uniform_(0.5, 1.5)
        cnn.bn.bias.normal_()
    return cnn


class DropNet(nn.Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.fc1 = nn.Linear(8, 16, bias=False)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


class Order(nn.Module):
    """Parameters registered in another order than they are used."""
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.rand(16) + 0.5)
        self.body = nn.Linear(8, 16)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)) * self.scale)


class Tied(nn.Module):
    def __init__(self, tie=True):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.body(self.emb(idx))))


def tied_x():
    return torch.randint(0, 10, (2, 5))


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def clone_model(m):
    return copy.deepcopy(m)


# ============================================================================= probes
# ----------------------------------------------------------------------------- parameter order / names

@probe("params")
def p_names_transformer(tracer):
    m = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, 16)
    amp = conv(m, x, tracer)
    d = names_match(m, amp)
    close(amp(x), ref(lambda: m(x)))
    return d


@probe("params", ALL3)
def p_names_cnn_bn(tracer):
    m = CNN()
    x = cnn_x()
    amp = conv(m, x, tracer)
    return names_match(m, amp)


@probe("params")
def p_names_tied(tracer):
    m = Tied()
    x = tied_x()
    amp = conv(m, x, tracer)
    d = names_match(m, amp)
    close(amp(x), ref(lambda: m(x)))
    return d


@probe("params")
def p_names_reordered(tracer):
    m = Order()
    amp = conv(m, xin(), tracer)
    return names_match(m, amp)


@probe("params")
def p_zip_pairing(tracer):
    m = Order()
    amp = conv(m, xin(), tracer)
    pairs = list(zip(m.parameters(), amp.parameters()))
    check(len(list(m.parameters())) == len(list(amp.parameters())), "parameter counts differ")
    for i, (p, q) in enumerate(pairs):
        check(p is q, f"pair {i}: model {tuple(p.shape)} vs amp {tuple(q.shape)} not the same tensor")
    return f"{len(pairs)} pairs identical"


@probe("params")
def p_vector_roundtrip(tracer):
    m = Order()
    x = xin()
    amp = conv(m, x, tracer)
    before = [p.detach().clone() for p in m.parameters()]
    v = nn.utils.parameters_to_vector(amp.parameters())
    v = v + 0.0
    nn.utils.vector_to_parameters(v, m.parameters())
    for i, (p, b) in enumerate(zip(m.parameters(), before)):
        check(torch.equal(p.detach(), b), f"model param {i} scrambled by amp-order vector")
    close(amp(x), ref(lambda: m(x)))
    return "vector from amp.parameters() written back into model.parameters() is identity"


@probe("params")
def p_swa_update_from_amp(tracer):
    m = Order()
    x = xin()
    amp = conv(m, x, tracer)
    swa = torch.optim.swa_utils.AveragedModel(m)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.5)
    swa.update_parameters(amp)               # first update: copies
    for (n, p), q in zip(m.named_parameters(), swa.module.parameters()):
        close(q, p, f"swa {n} after first update", 1e-6)
    first = [p.detach().clone() for p in m.parameters()]
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    swa.update_parameters(amp)               # average of the two
    for (n, p), f0, q in zip(m.named_parameters(), first, swa.module.parameters()):
        close(q, (f0 + p.detach()) / 2, f"swa {n} average", 1e-6)
    return "AveragedModel.update_parameters(amp) pairs like model"


@probe("params")
def p_ema_use_buffers_from_amp(tracer):
    m = seasoned(CNN())
    x = cnn_x()
    amp = conv(m, x, tracer)
    avg = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    ema_a = torch.optim.swa_utils.AveragedModel(m, multi_avg_fn=avg, use_buffers=True)
    ema_m = torch.optim.swa_utils.AveragedModel(m, multi_avg_fn=avg, use_buffers=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        amp(x).pow(2).mean().backward()
        opt.step()
        ema_a.update_parameters(amp)
        ema_m.update_parameters(m)
    sa, sm = ema_a.module.state_dict(), ema_m.module.state_dict()
    for k in sm:
        if sm[k].dtype.is_floating_point:
            close(sa[k], sm[k], f"ema {k}", 1e-5)
    return "EMA(use_buffers) fed amp == fed model"


@probe("params")
def p_optimizer_state_transfer(tracer):
    m = Order()
    x = xin()
    amp = conv(m, x, tracer)
    opt_a = torch.optim.Adam(amp.parameters(), lr=1e-2)
    for _ in range(2):
        opt_a.zero_grad()
        amp(x).pow(2).mean().backward()
        opt_a.step()
    sd = copy.deepcopy(opt_a.state_dict())
    opt_m = torch.optim.Adam(m.parameters(), lr=1e-2)
    opt_m.load_state_dict(sd)
    for n, p in m.named_parameters():
        check(p in opt_a.state, f"{n} not in amp optimizer's state (amp.parameters() are other tensors)")
        close(opt_m.state[p]["exp_avg"], opt_a.state[p]["exp_avg"], f"exp_avg {n}", 1e-6)
    return "optimizer state over amp.parameters() loads into one over model.parameters()"


@probe("params")
def p_state_dict_save_load_model(tracer):
    m = CNN()
    x = cnn_x()
    amp = conv(m, x, tracer)
    buf = io.BytesIO()
    torch.save(amp.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    fresh = CNN()
    fresh.load_state_dict(sd)                      # strict
    m.load_state_dict(sd)                          # back into the model itself, strict
    m.eval()
    fresh.eval()
    close(ref(lambda: fresh(x)), ref(lambda: m(x)), "fresh model from amp.state_dict()", 1e-6)
    return "torch.save(amp.state_dict()) loads strictly into the model class"


@probe("params")
def p_amp_load_state_dict_inplace(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    other = mlp()
    amp.load_state_dict(other.state_dict())
    close(ref(lambda: m(x)), ref(lambda: other(x)), "model after amp.load_state_dict", 1e-6)
    close(amp(x), ref(lambda: other(x)))
    return "amp.load_state_dict copies into the model's tensors"


# ----------------------------------------------------------------------------- modes

class NormEvalCNN(CNN):
    """mmdet-style norm_eval: train() keeps BatchNorm in eval mode."""
    def train(self, mode=True):
        super().train(mode)
        if mode:
            for mod in self.modules():
                if isinstance(mod, nn.BatchNorm2d):
                    mod.eval()
        return self


@probe("modes")
def p_norm_eval_amp_roundtrip(tracer):
    torch.manual_seed(1)
    m = seasoned(NormEvalCNN()).train()
    x = cnn_x()
    amp = conv(m, x, tracer)
    rm = m.bn.running_mean.clone()
    amp.eval()
    amp(x)
    amp.train()
    y = amp(x)
    check(torch.equal(m.bn.running_mean, rm), "BN running_mean changed in train mode (norm_eval override ignored)")
    want = ref(lambda: clone_model(m).train()(x))
    close(y, want)
    return "amp.eval(); amp.train() keeps the model's frozen BN"


@probe("modes")
def p_norm_eval_model_roundtrip(tracer):
    torch.manual_seed(1)
    m = seasoned(NormEvalCNN()).train()
    x = cnn_x()
    amp = conv(m, x, tracer)
    rm = m.bn.running_mean.clone()
    m.eval()
    amp(x)
    m.train()
    y = amp(x)
    check(torch.equal(m.bn.running_mean, rm), "BN running_mean changed after model.eval()/train() round trip")
    close(y, ref(lambda: clone_model(m)(x)))
    return "model.eval(); model.train() keeps the frozen BN"


@probe("modes", ALL3)
def p_model_eval_then_call(tracer):
    m = DropNet(0.5)
    with torch.no_grad():
        m.bn.running_mean.normal_()
    x = xin(8)
    amp = conv(m, x, tracer)
    m.eval()
    rm = m.bn.running_mean.clone()
    y = amp(x)
    check(torch.equal(m.bn.running_mean, rm), "running stats updated in eval mode")
    close(y, ref(lambda: m(x)))
    close(amp(x), y, "second eval call (deterministic)", 1e-6)
    return "model.eval() followed"


@probe("modes")
def p_model_submodule_bn_eval(tracer):
    m = seasoned(CNN()).train()
    x = cnn_x()
    amp = conv(m, x, tracer)
    m.bn.eval()
    m2 = clone_model(m)
    rm = m.bn.running_mean.clone()
    y = amp(x)
    check(torch.equal(m.bn.running_mean, rm), "BN running stats updated though model.bn.eval()")
    close(y, ref(lambda: m2(x)))
    return "model.bn.eval() on one submodule followed"


@probe("modes")
def p_amp_submodule_bn_eval(tracer):
    m = seasoned(CNN()).train()
    x = cnn_x()
    amp = conv(m, x, tracer)
    m2 = clone_model(m)
    m2.bn.eval()
    amp.get_submodule("bn").eval()
    rm = m.bn.running_mean.clone()
    y = amp(x)
    check(torch.equal(m.bn.running_mean, rm), "BN running stats updated though amp.bn.eval()")
    close(y, ref(lambda: m2(x)))
    return "amp.get_submodule('bn').eval() followed"


@probe("modes")
def p_amp_train_after_eval_convert(tracer):
    m = seasoned(CNN()).eval()
    x = cnn_x()
    amp = conv(m, x, tracer)
    m2 = clone_model(m).train()
    amp.train()
    y = amp(x)
    want = ref(lambda: m2(x))
    close(y, want)
    buffers_close(m, m2, "BN buffers after amp.train() call")
    return "amp.train() on an eval-converted model"


@probe("modes", ALL3)
def p_bn_train_running_stats(tracer):
    m = CNN().train()
    x = cnn_x()
    amp = conv(m, x, tracer)
    m2 = clone_model(m)
    for _ in range(2):
        amp(x)
        ref(lambda: m2(x))
    buffers_close(m, m2)
    return "BN running stats + num_batches_tracked updated like the model"


@probe("modes")
def p_bn_momentum_change(tracer):
    m = CNN().train()
    x = cnn_x()
    amp = conv(m, x, tracer)
    m.bn.momentum = 0.9
    m2 = clone_model(m)
    amp(x)
    ref(lambda: m2(x))
    buffers_close(m, m2)
    return "bn.momentum change followed"


@probe("modes")
def p_bn_momentum_none(tracer):
    m = CNN().train()
    x = cnn_x()
    amp = conv(m, x, tracer)
    m.bn.momentum = None                   # cumulative moving average
    m2 = clone_model(m)
    for _ in range(2):
        amp(x * 2)
        ref(lambda: m2(x * 2))
    buffers_close(m, m2)
    return "bn.momentum=None (cumulative) followed"


@probe("modes")
def p_freeze_submodule_requires_grad(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    m[0].requires_grad_(False)
    m2 = clone_model(m)
    amp(x).pow(2).sum().backward()
    ref(lambda: m2(x).pow(2).sum().backward())
    grads_close(m, m2)
    return "requires_grad_(False) after convert respected"


@probe("modes")
def p_amp_submodule_requires_grad(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    amp.get_submodule("0").requires_grad_(False)
    check(not m[0].weight.requires_grad, "amp.get_submodule('0').requires_grad_(False) did not reach model[0]")
    amp(x).pow(2).sum().backward()
    check(m[0].weight.grad is None, "frozen weight got a gradient")
    check(m[2].weight.grad is not None, "unfrozen weight got no gradient")
    return "freezing through amp reaches the model"


@probe("modes")
def p_unfreeze_bn(tracer):
    m = seasoned(CNN()).train()
    m.bn.requires_grad_(False)
    x = cnn_x()
    amp = conv(m, x, tracer)
    m.bn.requires_grad_(True)
    m2 = clone_model(m)
    amp(x).pow(2).sum().backward()
    ref(lambda: m2(x).pow(2).sum().backward())
    check(m.bn.weight.grad is not None, "unfrozen BN weight got no gradient")
    grads_close(m, m2)
    return "BN unfrozen after convert trains"


@probe("modes")
def p_transformer_eval_nograd(tracer):
    m = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    x = torch.randn(2, 5, 16)
    amp = conv(m, x, tracer)
    m.eval()
    with torch.no_grad():
        y = amp(x)
        want = ref(lambda: m(x))
    close(y, want)
    return "TransformerEncoderLayer eval + no_grad (fast path in the model)"


# ----------------------------------------------------------------------------- Python values

@probe("pyvalue", ALL3)
def p_dropout_p_change(tracer):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.0))
    x = xin(32)
    amp = conv(m, x, tracer)
    m[2].p = 1.0                              # drop everything: output must be 0
    y = amp(x)
    check(y.abs().max() == 0, f"dropout p 0 -> 1.0 after convert ignored (max |y| {y.abs().max():.3g})")
    m[2].p = 0.5                              # kept units are scaled by 2, the others are 0
    y = amp(x)
    h = ref(lambda: m[1](m[0](x))).detach()
    on = h > 0.1
    ratio = y[on] / h[on]
    zeros = (ratio.abs() < 0.05).sum().item()
    twos = ((ratio - 2).abs() < 0.05).sum().item()
    check(zeros + twos == on.sum().item() and zeros > 0 and twos > 0,
          f"dropout p=0.5: unit scales not in {{0, 2}} ({zeros} zero, {twos} doubled of {on.sum().item()})")
    return f"p=1.0 and p=0.5 followed ({zeros} dropped / {twos} kept)"


class Temp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.t = 1.0

    def forward(self, x):
        return torch.softmax(self.fc(x) / self.t, -1)


@probe("pyvalue", ALL3)
def p_temperature_attr(tracer):
    m = Temp()
    x = xin() * 4
    amp = conv(m, x, tracer)
    m.t = 8.0
    close(amp(x), ref(lambda: m(x)))
    return "float attribute change followed"


class Flag(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.flag = False

    def forward(self, x):
        y = self.fc(x)
        if self.flag:
            y = y * 2 + 1
        return y


@probe("pyvalue", ALL3)
def p_bool_flag(tracer):
    m = Flag()
    x = xin()
    amp = conv(m, x, tracer)
    m.flag = True
    close(amp(x), ref(lambda: m(x)))
    return "bool flag change followed"


@probe("pyvalue")
def p_layernorm_eps(tracer):
    m = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    x = xin()
    amp = conv(m, x, tracer)
    m[1].eps = 10.0
    close(amp(x), ref(lambda: m(x)))
    return "LayerNorm eps change followed"


@probe("pyvalue")
def p_leaky_slope(tracer):
    m = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.01), nn.Linear(16, 4))
    x = xin()
    amp = conv(m, x, tracer)
    m[1].negative_slope = 0.9
    close(amp(x), ref(lambda: m(x)))
    return "LeakyReLU slope change followed"


class DropPath(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.p = p

    def forward(self, x):
        if self.p == 0 or not self.training:
            return x
        keep = 1 - self.p
        mask = x.new_empty(x.shape[0], 1).bernoulli_(keep)
        return x * mask / keep


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.dp = DropPath(0.0)

    def forward(self, x):
        return x + self.dp(self.fc(x))


@probe("pyvalue", ALL3)
def p_drop_path_schedule(tracer):
    m = Residual().train()
    x = torch.randn(32, 8)
    amp = conv(m, x, tracer)
    m.dp.p = 0.5                             # schedule raises the rate
    y = amp(x)
    branch = ref(lambda: m.fc(x)).detach()
    ratio = ((y - x) * branch).sum(1) / (branch * branch).sum(1)    # per-sample scale of the branch
    dropped = (ratio.abs() < 0.1).sum().item()
    doubled = ((ratio - 2).abs() < 0.1).sum().item()
    check(dropped + doubled == x.shape[0],
          f"branch scale per sample not in {{0, 2}}: {dropped} dropped, {doubled} doubled of {x.shape[0]} "
          f"(mean ratio {ratio.mean():.2f}) -> drop_path rate change ignored")
    return f"drop path applied: {dropped} dropped / {doubled} scaled"


GLOBAL_SCALE = 1.0


class GlobalUser(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x) * GLOBAL_SCALE


@probe("pyvalue")
def p_global_constant(tracer):
    global GLOBAL_SCALE
    m = GlobalUser()
    x = xin()
    amp = conv(m, x, tracer)
    GLOBAL_SCALE = 3.0
    try:
        close(amp(x), ref(lambda: m(x)))
    finally:
        GLOBAL_SCALE = 1.0
    return "module-level global change followed"


class Cfg(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.cfg = {"scale": 1.0, "act": "relu"}

    def forward(self, x):
        y = self.fc(x) * self.cfg["scale"]
        return torch.relu(y) if self.cfg["act"] == "relu" else torch.tanh(y)


@probe("pyvalue")
def p_config_dict_mutation(tracer):
    m = Cfg()
    x = xin()
    amp = conv(m, x, tracer)
    m.cfg["scale"] = 3.0
    m.cfg["act"] = "tanh"
    close(amp(x), ref(lambda: m(x)))
    return "config dict mutated in place followed"


class Loop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.n = 1

    def forward(self, x):
        for _ in range(self.n):
            x = torch.tanh(self.fc(x))
        return x


@probe("pyvalue")
def p_int_loop_count(tracer):
    m = Loop()
    x = xin()
    amp = conv(m, x, tracer)
    m.n = 3
    close(amp(x), ref(lambda: m(x)))
    return "loop count change followed"


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.mask = torch.ones(8)            # plain tensor attribute, not a buffer

    def forward(self, x):
        return self.fc(x * self.mask)


@probe("pyvalue", ALL3)
def p_plain_tensor_attr_reassigned(tracer):
    m = Masked()
    x = xin()
    amp = conv(m, x, tracer)
    m.mask = torch.tensor([0., 0., 0., 0., 1., 1., 1., 1.]) * 3
    close(amp(x), ref(lambda: m(x)))
    return "plain tensor attribute reassignment followed"


@probe("pyvalue")
def p_plain_tensor_attr_inplace(tracer):
    m = Masked()
    x = xin()
    amp = conv(m, x, tracer)
    m.mask[:4] = 0
    close(amp(x), ref(lambda: m(x)))
    return "plain tensor attribute in-place edit followed"


# ----------------------------------------------------------------------------- hooks

@probe("hooks", ALL3)
def p_hook_fwd_model_sub(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    m[0].register_forward_hook(lambda mod, i, o: o * 2 + 1)
    close(amp(x), ref(lambda: m(x)))
    return "forward hook on model[0] added after convert runs"


@probe("hooks")
def p_hook_pre_model_sub(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    m[2].register_forward_pre_hook(lambda mod, args: (args[0] * 0 + 1,))
    close(amp(x), ref(lambda: m(x)))
    return "forward pre-hook on model[2] runs"


@probe("hooks")
def p_hook_bwd_model_sub(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    seen = []
    m[2].register_full_backward_hook(lambda mod, gi, go: seen.append(go[0].detach().clone()))
    amp(x).pow(2).sum().backward()
    check(len(seen) == 1, f"full backward hook on model[2] called {len(seen)} times, expected 1")
    out = ref(lambda: m(x))
    close(seen[0], 2 * out.detach(), "grad_output seen by hook", 0.05)
    return "full backward hook on model[2] called with the right grad_output"


@probe("hooks")
def p_hook_feature_extract(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    feats = {}
    m[1].register_forward_hook(lambda mod, i, o: feats.__setitem__("relu", o.detach()))
    amp(x)
    check("relu" in feats, "feature-extraction hook on model[1] never fired")
    got = feats.pop("relu")
    ref(lambda: m(x))
    # the activation is computed in bfloat16 (as under torch.autocast): its values, not its dtype, are the model's
    close(got, feats["relu"], "captured feature", dtype=False)
    return "feature hook fired with the right activation"


@probe("hooks")
def p_hook_fwd_amp_sub(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    m2 = clone_model(m)
    m2[0].register_forward_hook(lambda mod, i, o: o * 2 + 1)
    amp.get_submodule("0").register_forward_hook(lambda mod, i, o: o * 2 + 1)
    close(amp(x), ref(lambda: m2(x)))
    return "forward hook on amp's submodule runs"


@probe("hooks")
def p_hook_fwd_amp_root(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    want = ref(lambda: m(x)) * 2 + 1
    amp.register_forward_hook(lambda mod, i, o: o * 2 + 1)
    close(amp(x), want)
    return "forward hook on amp itself runs"


@probe("hooks")
def p_hook_pre_amp_root(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    want = ref(lambda: m(x * 3))
    amp.register_forward_pre_hook(lambda mod, args: (args[0] * 3,))
    close(amp(x), want)
    return "forward pre-hook on amp itself runs"


@probe("hooks")
def p_hook_fwd_model_root(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    m.register_forward_hook(lambda mod, i, o: o * 2 + 1)
    close(amp(x), ref(lambda: m(x)))
    return "forward hook on the model root added after convert runs"


@probe("hooks")
def p_hook_bwd_model_root(tracer):
    m = mlp()
    x = xin().requires_grad_()
    amp = conv(m, x.detach(), tracer)
    seen = []
    m.register_full_backward_hook(lambda mod, gi, go: seen.append(1))
    amp(x).sum().backward()
    check(len(seen) == 1, f"full backward hook on model root called {len(seen)} times, expected 1")
    return "full backward hook on the model root called"


@probe("hooks")
def p_hook_remove_existing(tracer):
    m = mlp()
    x = xin()
    h = m[0].register_forward_hook(lambda mod, i, o: o * 2 + 1)
    amp = conv(m, x, tracer)
    h.remove()
    close(amp(x), ref(lambda: m(x)))
    return "removing a hook present at convert time followed"


# ----------------------------------------------------------------------------- structure edits

@probe("structure", ALL3)
def p_bias_none(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    m[2].bias = None
    close(amp(x), ref(lambda: m(x)))
    return "bias=None followed"


@probe("structure", ALL3)
def p_replace_param_same_shape(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    m[0].weight = nn.Parameter(torch.randn(16, 8))
    close(amp(x), ref(lambda: m(x)))
    amp(x).sum().backward()
    check(m[0].weight.grad is not None, "new parameter got no gradient through amp")
    return "replaced Parameter followed and trained"


@probe("structure")
def p_replace_param_other_shape(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    m[2].weight = nn.Parameter(torch.randn(6, 16))
    m[2].bias = nn.Parameter(torch.randn(6))
    close(amp(x), ref(lambda: m(x)))
    return "parameter of another shape followed"


@probe("structure")
def p_data_assign_same_shape(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    m[0].weight.data = torch.randn(16, 8)
    close(amp(x), ref(lambda: m(x)))
    return ".data re-pointing (same shape) followed"


@probe("structure")
def p_data_assign_other_shape(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    m[2].weight.data = torch.randn(6, 16)
    m[2].bias.data = torch.randn(6)
    close(amp(x), ref(lambda: m(x)))
    return ".data of another shape followed"


@probe("structure")
def p_replace_buffer(tracer):
    m = seasoned(CNN()).eval()
    x = cnn_x()
    amp = conv(m, x, tracer)
    m.bn.running_mean = torch.randn(4) * 3
    close(amp(x), ref(lambda: m(x)))
    return "replaced BN buffer followed"


@probe("structure", ALL3)
def p_lsd_assign_model(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    sd = mlp().state_dict()
    m.load_state_dict(sd, assign=True)
    close(amp(x), ref(lambda: m(x)))
    amp(x).sum().backward()
    check(all(p.grad is not None for p in m.parameters()), "assigned parameters get no gradient through amp")
    return "model.load_state_dict(assign=True) followed"


@probe("structure")
def p_lsd_assign_amp(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    other = mlp()
    amp.load_state_dict(other.state_dict(), assign=True)
    y = amp(x)
    close(y, ref(lambda: other(x)), "amp output vs loaded weights")
    if rel(ref(lambda: m(x)), ref(lambda: other(x))) > 1e-6:
        raise Wrong("amp computes the loaded weights but the model keeps its old ones: amp and model no "
                    "longer share parameters (an optimizer over model.parameters() no longer trains amp)")
    return "amp.load_state_dict(assign=True) reaches the model"


@probe("structure")
def p_lsd_inplace_model(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    m.load_state_dict(mlp().state_dict())
    close(amp(x), ref(lambda: m(x)))
    return "model.load_state_dict (in place) followed"


@probe("structure")
def p_amp_to_float64(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    amp.to(torch.float64)
    y = amp(x.double())
    close(y, ref(lambda: m(x.double())))
    return f"amp.to(float64): output {y.dtype}, model weight {m[0].weight.dtype}"


@probe("structure")
def p_amp_half_fp16_input(tracer):
    m = mlp()
    x = xin()
    want = ref(lambda: m(x))
    amp = conv(m, x, tracer)
    amp.half()
    y = amp(x.half())
    close(y.float(), want, "output vs float32 model")
    want_dtype = ref(lambda: m(x.half())).dtype      # the model is half now too (shared parameters)
    check(y.dtype == want_dtype, f"output dtype {y.dtype}, the halved model gives {want_dtype}")
    return f"amp.half() then fp16 input: output {y.dtype}"


@probe("structure")
def p_amp_double_buffers(tracer):
    m = CNN().train()
    x = cnn_x()
    amp = conv(m, x, tracer)
    m2 = clone_model(m).double()
    amp.double()
    bad = [n for n, b in m.named_buffers() if b.is_floating_point() and b.dtype != torch.float64]
    check(not bad, f"amp.double() left model buffers {bad} float32 (model and amp no longer share them)")
    y = amp(x.double())
    close(y, ref(lambda: m2(x.double())))
    buffers_close(m, m2)
    return "amp.double(): model buffers float64 and updated"


@probe("structure")
def p_model_to_float64(tracer):
    m = CNN().train()
    x = cnn_x()
    amp = conv(m, x, tracer)
    m.to(torch.float64)
    m2 = clone_model(m)
    y = amp(x.double())
    close(y, ref(lambda: m2(x.double())))
    buffers_close(m, m2)
    return "model.to(float64) followed"


@probe("structure")
def p_convert_converted(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    amp2 = conv(amp, x, tracer)
    close(amp2(x), ref(lambda: m(x)))
    with torch.no_grad():
        m[0].weight.mul_(2)
    close(amp2(x), ref(lambda: m(x)), "after model[0].weight.mul_(2)")
    m[2].bias = nn.Parameter(torch.randn(4))
    close(amp2(x), ref(lambda: m(x)), "after model[2].bias = Parameter(...)")
    return "convert(amp) works and follows the model"


@probe("structure")
def p_inference_lsd_inplace(tracer):
    m = mlp().eval()
    x = xin()
    amp = conv(m, x, tracer, mode="inference")
    m.load_state_dict(mlp().state_dict())
    close(amp(x), ref(lambda: m(x)))
    return "mode=inference followed an in-place load_state_dict"


@probe("structure")
def p_inference_optimizer_step(tracer):
    m = mlp().eval()
    x = xin()
    amp = conv(m, x, tracer, mode="inference")
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(-1.5)
    close(amp(x), ref(lambda: m(x)))
    return "mode=inference followed an in-place weight update"


@probe("structure")
def p_replace_submodule(tracer):
    m = Two()
    x = xin()
    amp = conv(m, x, tracer)
    m.head = nn.Linear(16, 4)
    close(amp(x), ref(lambda: m(x)))
    return "swapped submodule followed"


@probe("structure")
def p_replace_activation(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    m[1] = nn.Tanh()
    close(amp(x), ref(lambda: m(x)))
    return "swapped activation followed"


class Aux(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.aux = nn.Linear(8, 4)

    def forward(self, x):
        y = self.fc(x)
        aux = getattr(self, "aux", None)
        if aux is not None:
            y = y + aux(x)
        return y


@probe("structure")
def p_del_submodule(tracer):
    m = Aux()
    x = xin()
    amp = conv(m, x, tracer)
    del m.aux
    close(amp(x), ref(lambda: m(x)))
    return "del model.aux followed"


@probe("structure")
def p_weight_norm_after(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    nn.utils.parametrizations.weight_norm(m[0])
    with torch.no_grad():
        m[0].parametrizations.weight.original0.mul_(3)
    close(amp(x), ref(lambda: m(x)))
    amp(x).sum().backward()
    check(m[0].parametrizations.weight.original0.grad is not None, "weight_norm g got no gradient")
    return "weight_norm added after convert followed"


@probe("structure")
def p_spectral_norm_after(tracer):
    m = mlp().eval()
    x = xin()
    amp = conv(m, x, tracer)
    nn.utils.parametrizations.spectral_norm(m[2])
    close(amp(x), ref(lambda: m(x)))
    return "spectral_norm added after convert followed"


@probe("structure")
def p_prune_after(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    nn.utils.prune.l1_unstructured(m[0], "weight", amount=0.7)
    close(amp(x), ref(lambda: m(x)))
    amp(x).sum().backward()
    check(m[0].weight_orig.grad is not None, "pruned weight_orig got no gradient")
    return "pruning after convert followed"


@probe("structure")
def p_tie_after(tracer):
    m = Tied(tie=False)
    x = tied_x()
    amp = conv(m, x, tracer)
    m.head.weight = m.emb.weight
    close(amp(x), ref(lambda: m(x)))
    return "tying weights after convert followed"


@probe("structure")
def p_amp_replace_submodule(tracer):
    m = Two()
    x = xin()
    amp = conv(m, x, tracer)
    new = nn.Linear(16, 4)
    m2 = clone_model(m)
    m2.head = copy.deepcopy(new)
    amp.head = new
    close(amp(x), ref(lambda: m2(x)))
    return "amp.head = new module used by amp"


@probe("structure")
def p_amp_replace_param(tracer):
    m = Two()
    x = xin()
    amp = conv(m, x, tracer)
    w = nn.Parameter(torch.randn(4, 16))
    m2 = clone_model(m)
    m2.head.weight = nn.Parameter(w.detach().clone())
    amp.get_submodule("head").weight = w
    close(amp(x), ref(lambda: m2(x)))
    return "amp.head.weight = Parameter used by amp"


# ----------------------------------------------------------------------------- Python state set in forward

class AttnBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)
        self.attn = None
        self.calls = 0

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / 8 ** 0.5, -1)
        self.attn = a.detach()
        self.calls += 1
        return a @ x


class AttnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = AttnBlock()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.block(x))


def seq_x(t=5):
    return torch.randn(2, t, 8)


@probe("pystate")
def p_attn_stored_for_vis(tracer):
    m = AttnNet()
    x = seq_x()
    amp = conv(m, x, tracer)
    m.block.attn = None
    amp(x)
    got = m.block.attn
    where = [n for n, mod in amp.named_modules() if getattr(mod, "attn", None) is not None]
    check(got is not None, f"model.block.attn not set by amp's call (set on amp modules {where})")
    m2 = clone_model(m)
    ref(lambda: m2(x))
    close(got, m2.block.attn, "stored attention")
    return "attention map lands on model.block.attn"


@probe("pystate", ALL3)
def p_call_counter(tracer):
    m = AttnNet()
    x = seq_x()
    amp = conv(m, x, tracer)
    c0 = m.block.calls
    for _ in range(3):
        amp(x)
    where = {n: mod.calls for n, mod in amp.named_modules() if isinstance(getattr(mod, "calls", None), int)}
    check(m.block.calls == c0 + 3, f"model.block.calls went {c0} -> {m.block.calls}, expected {c0 + 3} "
                                   f"(amp modules' counters: {where})")
    return "call counter on the model's module incremented"


class History(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.history = []

    def forward(self, x):
        y = self.fc(x)
        self.history.append(float(y.detach().abs().mean()))
        return y


@probe("pystate")
def p_history_list(tracer):
    m = History()
    x = xin()
    amp = conv(m, x, tracer)
    n0 = len(m.history)
    amp(x)
    where = {n: len(mod.history) for n, mod in amp.named_modules() if isinstance(getattr(mod, "history", None), list)}
    check(len(m.history) == n0 + 1, f"model.history grew by {len(m.history) - n0}, expected 1 "
                                     f"(amp modules' history lengths: {where})")
    return f"history list appended (len {n0} -> {len(m.history)})"


# ----------------------------------------------------------------------------- convert() leaves model-owned state alone

class Noise(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.g = torch.Generator().manual_seed(123)

    def forward(self, x):
        return self.fc(x) + torch.rand(x.shape[0], 4, generator=self.g) * 2


@probe("world")
def p_generator_attr_untouched(tracer):
    m = Noise()
    x = xin()
    s0 = m.g.get_state().clone()
    amp = conv(m, x, tracer)
    if not torch.equal(m.g.get_state(), s0):
        probe_g = torch.Generator().manual_seed(123)
        n = 0
        while n < 50 and not torch.equal(probe_g.get_state(), m.g.get_state()):
            torch.rand(x.shape[0], 4, generator=probe_g)
            n += 1
        m.g.set_state(s0)
        y = amp(x)
        used = not torch.equal(m.g.get_state(), s0)
        raise Wrong(f"convert() advanced the model's own torch.Generator (by {n if n < 50 else '?'} forward "
                    f"draws); amp's call {'draws from it' if used else 'does not draw from it'}")
    m.g.set_state(s0)
    y = amp(x)
    s1 = m.g.get_state().clone()
    m.g.set_state(s0)
    want = ref(lambda: m(x))
    check(torch.equal(m.g.get_state(), s1), "amp's call did not draw from the model's generator like the model does")
    close(y, want)
    return "model's generator untouched by convert and used by amp"


class PyRandom(nn.Module):
    """Draws from Python's random (in control flow and in arithmetic) and from numpy."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.drop = nn.Dropout(0.1)
        self.p_skip = 0.0

    def forward(self, x):
        if self.training and random.random() < self.p_skip:
            return x[:, :4]
        jitter = random.uniform(0.0, 1e-9)
        noise = float(np.random.rand()) * 1e-9
        return self.drop(self.fc(x)) + noise + jitter


@probe("world")
def p_rng_untouched(tracer):
    m = PyRandom()
    x = xin()
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    s_py, s_np, s_t = random.getstate(), np.random.get_state(), torch.get_rng_state()
    conv(m, x, tracer)
    bad = []
    if random.getstate() != s_py:
        bad.append("Python random")
    s2 = np.random.get_state()
    if not (np.array_equal(s2[1], s_np[1]) and s2[2] == s_np[2]):
        bad.append("numpy")
    if not torch.equal(torch.get_rng_state(), s_t):
        bad.append("torch CPU")
    check(not bad, f"convert() changed the global RNG state of: {', '.join(bad)}")
    return "python/numpy/torch RNG untouched by convert"


@probe("world")
def p_model_untouched_by_convert(tracer):
    m = AttnNet()
    x = seq_x()
    m.block.attn = "sentinel"
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    conv(m, x, tracer)
    check(m.block.attn == "sentinel", f"convert() overwrote model.block.attn ({type(m.block.attn).__name__})")
    check(m.block.calls == 0, f"convert() left model.block.calls = {m.block.calls}")
    for k, v in m.state_dict().items():
        check(torch.equal(v, sd[k]), f"convert() changed {k}")
    return "model attributes and state unchanged by convert"


# ----------------------------------------------------------------------------- crashes

class JitSub(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = torch.jit.script(nn.Linear(16, 4))

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


@probe("crash")
def p_jit_script_submodule(tracer):
    m = JitSub()
    x = xin()
    amp = conv(m, x, tracer)
    close(amp(x), ref(lambda: m(x)))
    return "scripted submodule ok"


@probe("crash")
def p_jit_script_root(tracer):
    m = torch.jit.script(mlp())
    x = xin()
    amp = conv(m, x, tracer)
    close(amp(x), ref(lambda: m(x)))
    return "scripted root ok"


class Kw(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, flag=False, mix=(0.5, 0.5)):
        y = self.fc(x)
        if flag:
            y = y * mix[0] + mix[1]
        return y


@probe("crash")
def p_kwarg_flag_true(tracer):
    m = Kw()
    x = xin()
    amp = conv(m, x, tracer)
    close(amp(x, flag=True), ref(lambda: m(x, flag=True)))
    return "flag=True call ok"


@probe("crash")
def p_kwarg_mix_tuple(tracer):
    m = Kw()
    x = xin()
    amp = conv(m, x, tracer)
    close(amp(x, True, (2.0, -1.0)), ref(lambda: m(x, True, (2.0, -1.0))))
    close(amp(x, flag=True, mix=(3.0, 1.0)), ref(lambda: m(x, flag=True, mix=(3.0, 1.0))), "kwargs")
    return "positional/keyword tuple argument ok"


class FFT(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return torch.fft.rfft(self.fc(x), dim=-1).abs()


@probe("crash")
def p_fft_after_linear(tracer):
    m = FFT()
    x = xin()
    amp = conv(m, x, tracer)
    close(amp(x), ref(lambda: m(x)))
    return "rfft after Linear ok"


@probe("crash")
def p_deepcopy_amp(tracer):
    m = seasoned(CNN()).train()
    x = cnn_x()
    amp = conv(m, x, tracer)
    a2 = copy.deepcopy(amp)
    m2 = clone_model(m)
    close(a2(x), ref(lambda: m2(x)))
    a2.eval()
    m2.eval()
    close(a2(x), ref(lambda: m2(x)), "deepcopy in eval")
    return "deepcopy(amp) callable in both modes"


@probe("crash")
def p_pickle_amp(tracer):
    m = seasoned(CNN()).eval()
    x = cnn_x()
    amp = conv(m, x, tracer)
    a2 = pickle.loads(pickle.dumps(amp))
    close(a2(x), ref(lambda: m(x)))
    return "pickle round trip ok"


@probe("crash")
def p_torch_compile_amp(tracer):
    m = DropNet(0.0)
    with torch.no_grad():
        m.bn.running_mean.normal_()
    x = xin(8)
    amp = conv(m, x, tracer)
    ca = torch.compile(amp, backend="eager")
    m2 = clone_model(m)
    close(ca(x), ref(lambda: m2(x)), "compiled, unchanged model")
    with torch.no_grad():
        m.fc2.weight.mul_(-1)
    close(ca(x), ref(lambda: clone_model(m)(x)), "compiled, after in-place weight change")
    m.fc2.weight = nn.Parameter(torch.randn(4, 16))
    close(ca(x), ref(lambda: clone_model(m)(x)), "compiled, after model.fc2.weight = Parameter")
    m.eval()
    close(ca(x), ref(lambda: m(x)), "compiled, after model.eval()")
    return "torch.compile(amp, eager) follows in-place, replaced weights and model.eval()"


@probe("crash")
def p_torch_compile_amp_attr(tracer):
    m = Temp()
    x = xin() * 4
    amp = conv(m, x, tracer)
    ca = torch.compile(amp, backend="eager")
    close(ca(x), ref(lambda: m(x)), "compiled, unchanged model")
    m.t = 2.0
    plain_ok = rel(amp(x), ref(lambda: m(x))) < TOL
    try:
        close(ca(x), ref(lambda: m(x)), "compiled, t changed to 2 after compile")
    except Wrong as e:
        raise Wrong(f"{e} (uncompiled amp {'right' if plain_ok else 'wrong too'})")
    return "torch.compile(amp, eager) follows an attribute change"


# ----------------------------------------------------------------------------- errors

class Rope(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.cache_len = 0
        self.cache = None

    def forward(self, x):
        T = x.shape[1]
        if T > self.cache_len:
            pos = torch.arange(T, dtype=torch.float32)[:, None] * torch.arange(1, 9, dtype=torch.float32) * 0.3
            self.cache = torch.cos(pos)
            self.cache_len = T
        return self.fc(x) * self.cache[:T]


@probe("errors", ALL3)
def p_rotary_cache_longer_seq(tracer):
    m = Rope()
    amp = conv(m, seq_x(4), tracer)
    for t in (4, 7, 5):
        x = seq_x(t)
        close(amp(x), ref(lambda: clone_model(m)(x)), f"T={t}")
    return "growing cache followed over T=4,7,5"


class OutBuf(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.register_buffer("buf", torch.zeros(4, 4))

    def forward(self, x):
        y = self.fc(x)
        torch.add(y, 1.0, out=self.buf)
        return self.buf * 2


@probe("errors")
def p_out_buffer_no_grad(tracer):
    m = OutBuf()
    x = xin()
    with torch.no_grad():
        amp = conv(m, x, tracer)
        y = amp(x)
        got_buf = m.buf.clone()
        m2 = clone_model(m)
        want = ref(lambda: m2(x))
    close(y, want)
    close(got_buf, m2.buf, "model.buf written by out=")
    return "out= buffer written under no_grad"


@probe("errors", ALL3)
def p_smaller_last_batch(tracer):
    m = mlp()
    x = xin(4)
    amp = conv(m, x, tracer)
    x3 = xin(3)
    close(amp(x3), ref(lambda: m(x3)))
    return "smaller last batch ok"


@probe("errors")
def p_larger_batch(tracer):
    m = DropNet(0.0)
    x = xin(4)
    amp = conv(m, x, tracer)
    m2 = clone_model(m)
    x7 = xin(7)
    close(amp(x7), ref(lambda: m2(x7)))
    buffers_close(m, m2)
    return "larger batch ok"


@probe("errors")
def p_channels_last_input(tracer):
    m = seasoned(CNN()).eval()
    x = cnn_x()
    amp = conv(m, x, tracer)
    xc = x.to(memory_format=torch.channels_last)
    close(amp(xc), ref(lambda: m(xc)))
    return "channels_last input ok"


# ----------------------------------------------------------------------------- everyday loop things

def sgd_steps(model, fwd, xs, lr=0.1, momentum=0.0):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for x in xs:
        opt.zero_grad()
        fwd(x).pow(2).mean().backward()
        opt.step()
    return opt


def deltas_close(m, m2, p0, what="update", tol=0.05):
    for (n, p), (_, q) in zip(m.named_parameters(), m2.named_parameters()):
        close(p.detach() - p0[n], q.detach() - p0[n], f"{what} {n}", tol)


@probe("loop")
def p_train_parity_lr_change(tracer):
    m = mlp()
    x = xin(16)
    amp = conv(m, x, tracer)
    m2 = clone_model(m)
    p0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    xs = [xin(16) for _ in range(3)]
    opt = sgd_steps(m, amp, xs)
    opt2 = ref(lambda: sgd_steps(m2, m2, xs))
    for o in (opt, opt2):
        for g in o.param_groups:
            g["lr"] = 0.01
    for x_ in xs:
        for mod, f, o in ((m, amp, opt), (m2, m2, opt2)):
            o.zero_grad()
            f(x_).pow(2).mean().backward()
            o.step()
    deltas_close(m, m2, p0)
    return "SGD steps through amp match float32 (lr changed mid-way)"


@probe("loop")
def p_grad_accumulation(tracer):
    m = DropNet(0.0)
    x = xin(8)
    amp = conv(m, x, tracer)
    m2 = clone_model(m)
    p0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    xs = [xin(8), xin(8)]
    for mod, f in ((m, amp), (m2, m2)):
        opt = torch.optim.SGD(mod.parameters(), lr=0.1)
        opt.zero_grad()
        for x_ in xs:
            (f(x_).pow(2).mean() / 2).backward()
        opt.step()
    deltas_close(m, m2, p0)
    buffers_close(m, m2)
    close(amp(x), ref(lambda: m2(x)), "call after step")
    return "accumulated grads + step match"


@probe("loop")
def p_gradscaler_fp16(tracer):
    m = mlp()
    x = xin(16)
    amp = conv(m, x, tracer)
    if not STATE["identity"]:
        STATE["phase"] = "convert"
        amp = ampfx.convert(m, torch.float16, example_inputs=(x,), tracer=tracer)
        STATE["phase"] = "after"
    m2 = clone_model(m)
    p0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    xs = [xin(16) for _ in range(3)]
    for x_ in xs:
        opt.zero_grad()
        scaler.scale(amp(x_).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
    ref(lambda: sgd_steps(m2, m2, xs))
    deltas_close(m, m2, p0, "fp16+GradScaler update")
    return f"fp16 + GradScaler steps match (scale {scaler.get_scale():.0f})"


@probe("loop")
def p_checkpoint_amp(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    m2 = clone_model(m)
    from torch.utils.checkpoint import checkpoint
    checkpoint(amp, x, use_reentrant=False).pow(2).sum().backward()
    ref(lambda: m2(x).pow(2).sum().backward())
    grads_close(m, m2)
    return "checkpoint(amp) gradients match"


@probe("loop")
def p_checkpoint_amp_reentrant(tracer):
    m = DropNet(0.0)
    x = xin(8)
    amp = conv(m, x, tracer)
    m2 = clone_model(m)
    from torch.utils.checkpoint import checkpoint
    checkpoint(amp, x.clone().requires_grad_(), use_reentrant=True).pow(2).sum().backward()
    ref(lambda: checkpoint(m2, x.clone().requires_grad_(), use_reentrant=True).pow(2).sum().backward())
    grads_close(m, m2)
    buffers_close(m, m2, "BN buffers (reentrant checkpoint runs forward twice)")
    return "reentrant checkpoint(amp) gradients and BN stats match"


@probe("loop")
def p_freeze_first_layer_mid_training(tracer):
    m = mlp()
    x = xin(16)
    amp = conv(m, x, tracer)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        amp(x).pow(2).mean().backward()
        opt.step()
    m[0].requires_grad_(False)
    w = m[0].weight.detach().clone()
    w2 = m[2].weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        amp(x).pow(2).mean().backward()
        opt.step()
    check(m[0].weight.grad is None, "frozen layer still gets gradients")
    check(torch.equal(m[0].weight.detach(), w), "frozen layer changed")
    check(not torch.equal(m[2].weight.detach(), w2), "unfrozen layer did not change")
    return "freezing mid-training respected"


@probe("loop")
def p_reinit_layer_inplace(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    nn.init.zeros_(m[0].weight)
    nn.init.constant_(m[0].bias, 0.5)
    close(amp(x), ref(lambda: m(x)))
    return "nn.init in place followed"


@probe("loop")
def p_apply_init(tracer):
    m = Two()
    x = xin()
    amp = conv(m, x, tracer)
    m.apply(lambda mod: nn.init.normal_(mod.weight, std=0.5) if isinstance(mod, nn.Linear) else None)
    close(amp(x), ref(lambda: m(x)))
    return "model.apply(init) followed"


@probe("loop")
def p_no_grad_validation_then_train(tracer):
    m = DropNet(0.0)
    x = xin(8)
    amp = conv(m, x, tracer)
    m.eval()
    with torch.no_grad():
        close(amp(x), ref(lambda: m(x)), "validation")
    m.train()
    m2 = clone_model(m)
    amp(x).pow(2).sum().backward()
    ref(lambda: m2(x).pow(2).sum().backward())
    grads_close(m, m2)
    buffers_close(m, m2)
    return "no_grad eval round then training step"


@probe("loop")
def p_inference_mode_call(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    with torch.inference_mode():
        y = amp(x)
    close(y, ref(lambda: m(x)))
    m2 = clone_model(m)
    amp(x).pow(2).sum().backward()
    ref(lambda: m2(x).pow(2).sum().backward())
    grads_close(m, m2)
    return "inference_mode call then training step"


@probe("loop")
def p_user_autocast_around_amp(tracer):
    m = seasoned(CNN()).train()
    x = cnn_x()
    amp = conv(m, x, tracer)
    m2 = clone_model(m)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = amp(x)
    close(y.float(), ref(lambda: m2(x)), dtype=False)
    buffers_close(m, m2, tol=0.05)
    return f"amp under user autocast ok ({y.dtype})"


@probe("loop")
def p_clip_grad_norm_amp_params(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    m2 = clone_model(m)
    amp(x).pow(2).sum().backward()
    ref(lambda: m2(x).pow(2).sum().backward())
    n1 = nn.utils.clip_grad_norm_(amp.parameters(), 0.1)
    n2 = nn.utils.clip_grad_norm_(m2.parameters(), 0.1)
    close(n1, n2, "grad norm")
    grads_close(m, m2, "clipped grad")
    return "clip_grad_norm_(amp.parameters()) clips the model's grads"


@probe("loop")
def p_amp_zero_grad(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    amp(x).sum().backward()
    amp.zero_grad()
    check(all(p.grad is None for p in m.parameters()), "amp.zero_grad() left model grads set")
    return "amp.zero_grad() clears the model's grads"


# ----------------------------------------------------------------------------- more everyday things

class OptMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        mask = getattr(self, "mask", None)
        if mask is not None:
            x = x * mask
        return self.fc(x)


@probe("structure")
def p_add_buffer_after(tracer):
    m = OptMask()
    x = xin()
    amp = conv(m, x, tracer)
    m.register_buffer("mask", torch.tensor([1., 0., 1., 0., 1., 0., 1., 0.]))
    close(amp(x), ref(lambda: m(x)))
    return "buffer registered after convert used"


@probe("modes")
def p_model_train_after_amp_eval(tracer):
    m = DropNet(0.0).train()
    with torch.no_grad():
        m.bn.running_mean.normal_()
    x = xin(8)
    amp = conv(m, x, tracer)
    amp.eval()
    amp(x)
    m.train()                                  # the model was already in train mode: its flag does not change
    m2 = clone_model(m)
    y = amp(x)
    close(y, ref(lambda: m2(x)), "output after amp.eval(); model.train()")
    buffers_close(m, m2)
    return "model.train() after amp.eval() wins"


@probe("structure")
def p_instance_forward_override(tracer):
    m = Two()
    x = xin()
    amp = conv(m, x, tracer)
    head = m.head
    m.head.forward = lambda h: F.linear(h, head.weight, head.bias) * 0.5 - 1
    close(amp(x), ref(lambda: m(x)))
    return "instance-level forward override followed"


@probe("loop")
def p_input_grad(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    xa = x.clone().requires_grad_()
    xm = x.clone().requires_grad_()
    amp(xa).pow(2).sum().backward()
    ref(lambda: m(xm).pow(2).sum().backward())
    check(xa.grad is not None, "input got no gradient")
    close(xa.grad, xm.grad, "input grad")
    return "gradient w.r.t. the input matches"


@probe("errors")
def p_noncontiguous_input(tracer):
    m = mlp()
    x = xin()
    amp = conv(m, x, tracer)
    xt = torch.randn(8, 4).t()
    close(amp(xt), ref(lambda: m(xt)))
    return "non-contiguous input ok"


@probe("modes")
def p_amp_eval_then_model_eval_train(tracer):
    m = seasoned(CNN()).train()
    x = cnn_x()
    amp = conv(m, x, tracer)
    amp.eval()
    m.eval()
    m.train()
    m2 = clone_model(m)
    y = amp(x)
    close(y, ref(lambda: m2(x)))
    buffers_close(m, m2)
    return "model.eval(); model.train() after amp.eval(): train mode"


class CkptNet(nn.Module):
    """Activation checkpointing inside the model's own forward."""
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return self.head(x)


@probe("loop")
def p_checkpoint_in_forward(tracer):
    m = CkptNet()
    x = xin(8)
    amp = conv(m, x, tracer)
    m2 = clone_model(m)
    amp(x).pow(2).sum().backward()
    ref(lambda: m2(x).pow(2).sum().backward())
    grads_close(m, m2)
    na, nm = m.blocks[0][1].num_batches_tracked.item(), m2.blocks[0][1].num_batches_tracked.item()
    check(na == nm, f"BN num_batches_tracked {na} through amp vs {nm} in the model: the model's checkpoint "
                    f"recomputes its blocks in backward, amp does not (checkpoint dropped: memory saving lost)")
    buffers_close(m, m2)
    return "checkpoint() inside the model's forward: grads and BN stats match"


# ============================================================================= runner

class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout("probe took longer than 90 s")


def classify(exc):
    mod = type(exc).__module__ or ""
    if mod.startswith("ampfx"):
        return "raises-clear"
    return "raises-unclear"


def one_line(s, n=200):
    s = " ".join(str(s).split())
    return s[:n]


def run_probe(fn, tracer, tb=False):
    STATE["phase"] = "setup"
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        try:
            detail = fn(tracer)
            outcome = "shows"
        except Wrong as e:
            outcome, detail = "SILENT-WRONG", str(e)
        except HarnessError as e:
            outcome, detail = "harness-error", str(e)
        except Timeout as e:
            outcome, detail = "raises-unclear", str(e)
        except Exception as e:  # noqa: BLE001
            if tb:
                traceback.print_exc()
            if STATE["phase"] == "setup":
                outcome = "harness-error"
            else:
                outcome = classify(e)
            where = "at convert" if STATE["phase"] == "convert" else "at call"
            detail = f"{where}: {type(e).__module__}.{type(e).__name__}: {one_line(e)}"
    amp_w = [w for w in ws if "ampfx" in (w.filename or "") or "ampfx" in str(w.message)[:200]]
    if amp_w:
        detail = f"{detail} [warn: {one_line(amp_w[0].message, 120)}]"
    return outcome, one_line(detail, 400)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--filter", default="")
    ap.add_argument("--tb", action="store_true", help="print tracebacks of exceptions")
    ap.add_argument("--identity", action="store_true",
                    help="self-check: skip ampfx, use the model itself as 'amp' (every probe should show, "
                         "except those that hook or change amp and the model separately)")
    args = ap.parse_args()
    STATE["identity"] = args.identity
    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, _alarm)
    counts = {}
    flagged = []
    t_all = time.time()
    import os
    import subprocess
    src = os.path.dirname(os.path.dirname(ampfx.__file__))
    try:
        rev = subprocess.run(["git", "-C", src, "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10).stdout.strip() or "not a git checkout"
    except Exception:  # noqa: BLE001
        rev = "?"
    print(f"# ampfx probe harness: torch {torch.__version__}, ampfx {ampfx.__file__} ({rev})")
    for name, category, fn, tracer in PROBES:
        if args.filter and args.filter not in name and args.filter != category:
            continue
        t0 = time.time()
        signal.alarm(90)
        try:
            outcome, detail = run_probe(fn, tracer, args.tb)
        finally:
            signal.alarm(0)
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome in ("SILENT-WRONG", "raises-unclear", "harness-error"):
            flagged.append((name, outcome, detail))
        print(f"{name} | {category} | {outcome} | {detail} ({time.time() - t0:.1f}s)", flush=True)
    print()
    print(f"# summary ({sum(counts.values())} probes, {time.time() - t_all:.0f}s): "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for name, outcome, detail in flagged:
        print(f"#   {outcome}: {name}: {detail[:160]}")


if __name__ == "__main__":
    main()
