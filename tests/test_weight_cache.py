"""Training mode's weight cache (ampfx.runtime.weight_cache): each weight a low op reads is cast once and reused by
every micro-batch and recompute until its float32 master changes; never stale; gradients as without it."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import ampfx
from ampfx.runtime import weight_cache
from ampfx.tools.measure import CastCounter
from support.models import build


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    """Two kept blocks (each its own graph module) and a head read by the root's graph."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


X = torch.randn(6, 8)


def pair(seed: int = 0, **options):
    """The model converted with the cache and without it (the per-call casts of before)."""
    torch.manual_seed(seed)
    model = Net()
    return model, ampfx.convert(model, "bf16", example_inputs=(X,), weight_cache=True, **options), \
        ampfx.convert(model, "bf16", example_inputs=(X,), weight_cache=False, **options)


def made(amp) -> int:
    return sum(c.casts for _, c in weight_cache.caches(amp))


def cached(amp) -> int:
    return sum(len(c.entries) for _, c in weight_cache.caches(amp))


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def accumulate(amp, model, k: int = 4) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for i in range(k):
        amp(X + i).pow(2).mean().backward()
    return grads(model)


def test_each_weight_is_cast_once_per_change_and_reused_by_every_micro_batch():
    """k micro-batches cast each cached weight once, and its gradient once (the first, when .grad is None): later
    micro-batches make only the activation casts, and the copies made count one per weight until the masters
    change."""
    model, amp, plain = pair()
    n = cached(amp)
    paths = {e.path for _, c in weight_cache.caches(amp) for e in c.entries}
    assert {"inp.weight", "head.weight", "fc1.weight", "fc2.weight"} <= paths, paths  # every Linear's weight
    per_batch = []
    for i in range(4):
        with CastCounter() as c:
            amp(X + i).sum().backward()
        per_batch.append(c.count)
    assert made(amp) == n
    # later micro-batches cast neither the weights (forward) nor their gradients (added into .grad in place)
    assert per_batch[1] == per_batch[2] == per_batch[3] == per_batch[0] - 2 * n
    with CastCounter() as c:
        plain(X).sum().backward()
    assert c.count == per_batch[0], "the first call casts what a conversion without the cache casts per call"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    for i in range(3):
        amp(X + i).sum().backward()
    assert made(amp) == 2 * n, "one refresh after the step, then reuse"


def test_checkpoint_recompute_reuses_the_cached_weights():
    """With activation checkpointing per block, the recompute in backward reads the same cached copies (no cast
    again), and the gradients are those of the conversion without the cache."""
    model, amp, plain = pair()
    for m in (amp, plain):
        blocks = set(m.blocks)
        apply_activation_checkpointing(m, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda b: b in blocks)
    want = accumulate(plain, model, k=2)
    with CastCounter() as with_cache:
        got = accumulate(amp, model, k=2)
    assert made(amp) == cached(amp), "the recompute cast nothing again"
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)
    with CastCounter() as without:
        accumulate(plain, model, k=2)
    assert with_cache.count < without.count


def _step(model, amp):
    amp(X).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()


def _fused_step(model, amp):
    """AdamW(fused=True), the HF Trainer's default optimizer: it writes the parameters without bumping their
    version counters (the cache kept the pre-step copies, and a fine-tune through the Trainer drifted silently)."""
    amp(X).sum().backward()
    torch.optim.AdamW(model.parameters(), lr=0.5, fused=True).step()


def _load(model, amp):
    torch.manual_seed(5)
    amp.load_state_dict(Net().state_dict())


def _load_assign(model, amp):
    torch.manual_seed(5)
    model.load_state_dict(Net().state_dict(), assign=True)


def _in_place(model, amp):
    with torch.no_grad():
        model.blocks[1].fc1.weight.mul_(-2)


def _copy(model, amp):
    with torch.no_grad():
        amp.head.weight.copy_(torch.randn_like(amp.head.weight))


def _data(model, amp):
    model.inp.weight.data = torch.randn_like(model.inp.weight)


def _replaced(model, amp):
    amp.blocks[0].fc2.weight = nn.Parameter(torch.randn_like(model.blocks[0].fc2.weight))


def _vector(model, amp):
    vector_to_parameters(parameters_to_vector(model.parameters()) * 3, model.parameters())


def _double_then_back(model, amp):
    model.double()
    model.float()


@pytest.mark.parametrize("change", [_step, _fused_step, _load, _load_assign, _in_place, _copy, _data, _replaced,
                                    _vector, _double_then_back], ids=lambda f: f.__name__.strip("_"))
def test_never_stale_after_the_master_changes(change):
    """Whatever changes a master between calls (an optimizer step, a fused one, load_state_dict, an in-place edit, copy_,
    .data =, a replaced parameter, vector_to_parameters, .double() and back), the next call computes with the new
    value: its output equals a conversion that casts the master at every call, bit for bit."""
    model, amp, plain = pair()
    amp(X).sum().backward()  # fill the cache
    change(model, amp)
    with torch.no_grad():
        torch.testing.assert_close(amp(X), plain(X), rtol=0, atol=0)
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(accumulate(amp, model, 2), accumulate(plain, model, 2), rtol=1e-6, atol=1e-7)


def test_attach_refreshes_right_after_the_step():
    """ampfx.attach(optimizer, amp): the step's hook refreshes the copies, so the next forward finds none stale."""
    model, amp, plain = pair()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    handle = ampfx.attach(opt, amp)
    amp(X).sum().backward()
    opt.step()
    assert made(amp) == 2 * cached(amp)
    assert [c.refresh() for _, c in weight_cache.caches(amp)] == [0] * len(weight_cache.caches(amp))
    torch.testing.assert_close(amp(X), plain(X), rtol=0, atol=0)
    handle.remove()
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        ampfx.attach(amp, opt)
    with pytest.raises(ValueError, match="no weight cache"):
        ampfx.attach(opt, plain)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "encoder_layer"])
def test_accumulated_gradients_equal_per_call_casts(name):
    """Four micro-batches accumulate the same float32 gradients as the conversion without the cache (within float32
    round-off: the low gradient is added into .grad in place instead of cast first), zeroed with set_to_none or
    to zeros."""
    model, ex, loss_fn = build(name)
    amp = ampfx.convert(model, "bf16", example_inputs=ex, weight_cache=True)
    plain = ampfx.convert(model, "bf16", example_inputs=ex, weight_cache=False)
    results = []
    for m in (amp, plain, amp):
        for set_to_none in (True, False):
            torch.manual_seed(1)  # the same dropout masks for each
            model.zero_grad(set_to_none=set_to_none)
            for _ in range(4):
                loss_fn(m(*ex)).backward()
            results.append(grads(model))
    for got, want in ((results[0], results[2]), (results[1], results[3]), (results[4], results[2])):
        assert got.keys() == want.keys() and got
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)


def test_gradient_hooks_retain_graph_autograd_grad_and_double_backward():
    """Where something watches or bypasses accumulation, the gradient takes the ordinary path: tensor hooks and
    post-accumulate-grad hooks fire as often as without the cache, autograd.grad returns the gradient and leaves
    .grad alone, retain_graph runs twice, create_graph builds a graph for a second derivative."""
    model, amp, plain = pair()
    seen = {"pre": 0, "post": 0}
    w = model.head.weight
    w.register_hook(lambda g: seen.__setitem__("pre", seen["pre"] + 1))
    w.register_post_accumulate_grad_hook(lambda p: seen.__setitem__("post", seen["post"] + 1))
    got = accumulate(amp, model, 3)
    assert seen == {"pre": 3, "post": 3}
    want = accumulate(plain, model, 3)
    torch.testing.assert_close(got["head.weight"], want["head.weight"], rtol=1e-6, atol=1e-7)

    before = grads(model)
    (g,) = torch.autograd.grad(amp(X).sum(), [model.inp.weight])
    (g_plain,) = torch.autograd.grad(plain(X).sum(), [model.inp.weight])
    torch.testing.assert_close(g, g_plain, rtol=0, atol=0)
    assert all(torch.equal(before[n], p.grad) for n, p in model.named_parameters() if n in before)

    model.zero_grad(set_to_none=True)
    out = amp(X).sum()
    out.backward(retain_graph=True)
    out.backward()
    twice = grads(model)
    model.zero_grad(set_to_none=True)
    plain(X).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(twice[n], 2 * p.grad, rtol=1e-6, atol=1e-7)

    x = X.clone().requires_grad_()
    (gx,) = torch.autograd.grad(amp(x).pow(2).sum(), [x], create_graph=True)
    gx.sum().backward()  # a second derivative reaches the masters through the cached copies
    assert model.inp.weight.grad is not None and torch.isfinite(model.inp.weight.grad).all()


def test_frozen_weights_and_no_grad_read_the_copies_directly():
    """A weight that does not require grad, or a call under no_grad, reads the cached copy itself (no autograd
    node, no cast), and the outputs are those of per-call casts."""
    model, amp, plain = pair()
    model.inp.requires_grad_(False)
    amp(X).sum().backward()
    with torch.no_grad(), CastCounter() as c:
        out = amp(X)
    with torch.no_grad(), CastCounter() as per_call:
        torch.testing.assert_close(out, plain(X), rtol=0, atol=0)
    assert c.count == per_call.count - cached(amp)
    assert model.inp.weight.grad is None


def test_copies_and_pickles_hold_no_copies_of_the_originals():
    """A deepcopy of the converted module caches its own masters (made at its first call); a pickled module
    reloads and runs; between calls no cache is active and none holds a call's tensors."""
    model, amp, plain = pair()
    amp(X).sum().backward()
    assert not getattr(ampfx.runtime.WEIGHTS, "active", None) and all(not c._by_id for _, c in weight_cache.caches(amp))
    other = copy.deepcopy(amp)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(2)
    torch.testing.assert_close(amp(X), plain(X), rtol=0, atol=0)
    assert not torch.equal(other(X), amp(X))
    loaded = pickle.loads(pickle.dumps(amp))
    torch.testing.assert_close(loaded(X), amp(X), rtol=0, atol=0)


def test_auto_by_default_on_and_off_by_policy_and_environment_and_none_in_inference_mode():
    """The cache is "auto" by default (tests/test_weight_cache_auto.py: these weights are too small for it to
    cache any); weight_cache=True and AMPFX_WEIGHT_CACHE=1 cache every cast weight; weight_cache=False,
    AMPFX_WEIGHT_CACHE=0 and mode='inference' (which keeps its own low copies) install none; the report says whether
    the cache is on and its memory."""
    torch.manual_seed(0)
    model = Net()
    on = ampfx.convert(model, "bf16", example_inputs=(X,), weight_cache=True)
    assert weight_cache.caches(ampfx.convert(model, "bf16", example_inputs=(X,), environ={"AMPFX_WEIGHT_CACHE": "1"}))
    note = next(n for n in on.ampfx_report.notes if n.startswith("weight cache"))
    numel = sum(e.owner[e.name].numel() for _, c in weight_cache.caches(on) for e in c.entries)
    assert note.startswith(f"weight cache: on, {cached(on)} weights") and f"({2 * numel:,} bytes" in note
    on(X)
    assert weight_cache.status(on).count(": on,") == 3 and f"{2 * numel:,} bytes" not in weight_cache.status(on)
    assert sum(c.nbytes() for _, c in weight_cache.caches(on)) == 2 * numel
    auto = ampfx.convert(model, "bf16", example_inputs=(X,), gemm_min_flops=0)
    assert weight_cache.caches(auto) == []  # none large enough: nothing installed
    assert any(n.startswith("weight cache: auto: 0 of ") for n in auto.ampfx_report.notes)
    for off in (ampfx.convert(model, "bf16", example_inputs=(X,), weight_cache=False),
                ampfx.convert(model, "bf16", example_inputs=(X,), environ={"AMPFX_WEIGHT_CACHE": "0"})):
        assert not weight_cache.caches(off)
        assert any(n.startswith("weight cache: off") for n in off.ampfx_report.notes)
    inference = ampfx.convert(model, "bf16", example_inputs=(X,), mode="inference")
    assert weight_cache.caches(inference) and all(c.reads_copies for _, c in weight_cache.caches(inference))
    assert "mode='inference'" in weight_cache.status(inference)
    with pytest.raises(ValueError, match="no weight cache"):  # its copies are made again before each call anyway
        ampfx.attach(torch.optim.SGD(inference.parameters(), lr=0.1), inference)
    with pytest.raises(ampfx.PolicyError, match="AMPFX_WEIGHT_CACHE='maybe'"):
        ampfx.convert(model, "bf16", environ={"AMPFX_WEIGHT_CACHE": "maybe"})


def test_torch_compile_reads_the_masters():
    """Under torch.compile the cache stands aside (inductor fuses the casts): the compiled module's gradients
    equal the eager cached ones."""
    model, amp, plain = pair()
    want = accumulate(amp, model, 2)
    compiled = torch.compile(amp, backend="aot_eager")
    got = accumulate(compiled, model, 2)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)


def test_a_graph_not_yet_backpropagated_keeps_the_copy_it_was_built_with():
    """Forward, change the weights in place, forward again, then both backwards: the refresh makes a new copy
    instead of writing over the one the first graph saved, so the gradients are those of per-call casts (an
    overwrite would compute the first graph's gradients with the new values)."""
    model, amp, plain = pair()
    results = []
    for m in (amp, plain):
        torch.manual_seed(0)
        model.load_state_dict(Net().state_dict())
        model.zero_grad(set_to_none=True)
        m(X).sum().backward()  # .grad exists: the second forward's copies come from the refresh, not a cast
        first = m(X).pow(2).sum()
        with torch.no_grad():  # the Linear weights: the graph saves only their low copies, never the masters
            for lin in [mod for mod in model.modules() if isinstance(mod, nn.Linear)]:
                lin.weight.mul_(0.5)
        second = m(X).pow(2).sum()
        first.backward()
        second.backward()
        results.append(grads(model))
    for n in results[1]:
        torch.testing.assert_close(results[0][n], results[1][n], rtol=1e-5, atol=1e-6)


def test_the_cache_lets_its_copies_go_where_it_stands_aside():
    """A module that starts using the cache and is then run where it stands aside (here: inside a torch.func
    transform) lets its copies go, and says why in status()."""
    model, amp, plain = pair()
    amp(X).sum().backward()
    assert all(c.nbytes() > 0 for _, c in weight_cache.caches(amp))
    params = dict(model.named_parameters())
    out = torch.func.functional_call(amp, params, (X,))
    torch.testing.assert_close(out, plain(X), rtol=0, atol=0)
    grads_f = torch.func.grad(lambda p: torch.func.functional_call(amp, p, (X,)).sum())(params)
    assert set(grads_f) == set(params)
    assert "inside a torch.func transform" in weight_cache.status(amp)
    assert all(c.nbytes() == 0 for _, c in weight_cache.caches(amp))
