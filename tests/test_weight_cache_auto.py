"""``weight_cache="auto"`` (the default): a weight is cached where a cached copy pays on the device (its size, from
the device cost table) and where it is read again before it changes (several calls between weight updates,
frozen, read twice a call); elsewhere nothing is held and the casts are autocast's."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                         checkpoint_wrapper)

import ampfx
from ampfx.ops import device_cost
from ampfx.runtime import weight_cache
from ampfx.tools.measure import CastCounter

WIDE = 256  # a 256 x 256 weight: 65,536 elements, the datasheet's CACHE_MIN_NUMEL (measuring is off in tests)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(WIDE, WIDE)  # weight large enough to pay; its bias (256 elements) is not
        self.small = nn.Linear(WIDE, 8)

    def forward(self, x):
        return self.small(F.relu(self.big(x)))


X = torch.randn(4, WIDE)


def convert(model: nn.Module, **options) -> nn.Module:
    return ampfx.convert(model, "bf16", example_inputs=(X,), gemm_min_flops=0, **options)


def step(amp, model, opt, k: int) -> int:
    """One optimizer step of ``k`` micro-batches; the casts it made."""
    with CastCounter() as c:
        for i in range(k):
            amp(X + i).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return c.count


def runs(k_per_step: list[int], **options):
    """The casts of each step, and the final weights, of a fresh model trained with ``k_per_step``."""
    torch.manual_seed(0)
    model = Block()
    amp = convert(model, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = [step(amp, model, opt, k) for k in k_per_step]
    return counts, {n: p.detach().clone() for n, p in model.named_parameters()}, amp


def test_the_default_is_auto_and_caches_only_large_weights():
    """The default caches, of the weights the graph casts, only those of at least the device's limit (the
    datasheet's here): the 256 x 256 weight, not the 8 x 256 one nor the biases; the report's note says so."""
    amp = convert(Block())
    (_, cache), = weight_cache.caches(amp)
    assert cache.auto is not None and [e.path for e in cache.auto.large] == ["big.weight"]
    assert {e.path for e in cache.entries} >= {"big.weight", "small.weight"}
    note = next(n for n in amp.ampfx_report.notes if n.startswith("weight cache"))
    assert note.startswith("weight cache: auto: 1 of ") and "from 65,536 elements, on cpu (datasheet)" in note


def test_one_micro_batch_a_step_caches_nothing_and_casts_as_without_the_cache():
    """With one forward a step (the usual case) nothing is cached, no copy is held, and every step casts what the
    conversion without a cache casts; the weights trained are the same."""
    auto, w_auto, amp = runs([1, 1, 1])
    off, w_off, _ = runs([1, 1, 1], weight_cache=False)
    assert auto == off
    assert all(torch.equal(w_auto[n], w_off[n]) for n in w_off)
    (_, cache), = weight_cache.caches(amp)
    assert cache.nbytes() == 0 and cache.live == [] and "auto, 0 of" in weight_cache.status(amp)


def test_gradient_accumulation_caches_the_large_weight_from_the_second_micro_batch():
    """With 4 micro-batches a step, the large weight is cached from the second call of the first step, and from
    the first call of every later one: fewer casts than without the cache (each saves the weight's cast and its
    gradient's), more than with every weight cached (the small ones are cast per call), and the weights trained
    equal those without the cache."""
    auto, w_auto, amp = runs([4, 4, 4])
    off, w_off, _ = runs([4, 4, 4], weight_cache=False)
    on, _, _ = runs([4, 4, 4], weight_cache=True)
    assert on[2] < auto[2] < off[2] and auto[1] == auto[2] and auto[0] > auto[1]
    assert off[2] - auto[2] == 2 * 3  # 3 later micro-batches: the weight's and its gradient's casts (the first makes the copy)
    for n in w_off:
        torch.testing.assert_close(w_auto[n], w_off[n], rtol=1e-5, atol=1e-6)
    (_, cache), = weight_cache.caches(amp)
    assert cache.nbytes() == 2 * WIDE * WIDE


def test_back_to_one_micro_batch_the_copy_is_let_go():
    """A run that accumulates, then trains one micro-batch a step: after one such step, nothing is held and the
    casts are those without a cache."""
    auto, _, amp = runs([4, 1, 1])
    off, _, _ = runs([4, 1, 1], weight_cache=False)
    assert auto[2] == off[2]
    (_, cache), = weight_cache.caches(amp)
    assert cache.nbytes() == 0


def test_a_frozen_large_weight_is_cached_at_one_micro_batch_a_step():
    """A frozen weight (requires_grad False: nothing steps it) is read unchanged by every call: from the second
    step its copy is kept, and its cast is saved at every step."""
    def frozen(**options):
        torch.manual_seed(0)
        model = Block()
        model.big.weight.requires_grad_(False)
        amp = convert(model, **options)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        return [step(amp, model, opt, 1) for _ in range(3)], model

    (auto, model), (off, _) = frozen(), frozen(weight_cache=False)
    assert auto[0] == off[0] and auto[2] == off[2] - 1  # the frozen weight's forward cast (it has no gradient)


def test_the_recompute_of_activation_checkpointing_reads_the_copy():
    """Under activation checkpointing each block's graph runs twice a step (forward and recompute): the large
    weight's copy made in the forward is read by the recompute, at one micro-batch a step."""
    def checkpointed(**options):
        torch.manual_seed(0)
        model = nn.Sequential(Block(), nn.Linear(8, 8))
        amp = ampfx.convert(model, "bf16", example_inputs=(X,), gemm_min_flops=0, keep_modules=[Block], **options)
        apply_activation_checkpointing(amp, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: type(m).__name__.startswith("Block"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        counts = [step(amp, model, opt, 1) for _ in range(3)]
        return counts, {n: p.detach().clone() for n, p in model.named_parameters()}

    (auto, w_auto), (off, w_off) = checkpointed(), checkpointed(weight_cache=False)
    assert auto[2] < off[2]
    for n in w_off:
        torch.testing.assert_close(w_auto[n], w_off[n], rtol=1e-5, atol=1e-6)


def test_the_limit_comes_from_the_measured_table(monkeypatch):
    """Where the device is measured, the limit is the table's (its cast and hand-off costs): a recorded table whose
    hand-off costs more caches nothing of this size, and the note names the table. A break-even given as a number
    measures nothing, for the cache either (the datasheet's limit)."""
    table = device_cost.Table("cpu: recorded", "2.13", "bfloat16",
                              tuple(device_cost.Point(r, w, 1.0, 0.5) for r, w in device_cost.LADDER),
                              cast_ns=0.1, handoff_ns=20000.0)
    assert table.cache_min_numel() == 111112
    monkeypatch.setattr(device_cost, "table", lambda *a, **k: table)
    monkeypatch.setattr(device_cost, "MEASURED_ON", ("cpu",))
    amp = ampfx.convert(Block(), "bf16", example_inputs=(X,))  # the GEMM break-even measured, so the cache's too
    assert weight_cache.caches(amp) == []  # no weight large enough: no cache, nothing checked at a call
    note = next(n for n in amp.ampfx_report.notes if n.startswith("weight cache"))
    assert "from 111,112 elements, measured on cpu: recorded" in note
    assert "(datasheet)" in next(n for n in convert(Block()).ampfx_report.notes if n.startswith("weight cache"))
    # a table without the hand-off cost (measured by an older ampfx) gives the datasheet's limit
    assert device_cost.Table("cpu", "2.13", "bfloat16", (), cast_ns=0.1).cache_min_numel() == \
        device_cost.CACHE_MIN_NUMEL


def test_the_environment_sets_auto_on_or_off_and_names_a_bad_value():
    model = Block()
    for value, want in (("auto", "auto"), ("1", True), ("0", False), ("", "auto")):
        amp = ampfx.convert(model, "bf16", example_inputs=(X,), environ={"AMPFX_WEIGHT_CACHE": value})
        assert amp.ampfx_report.policy["weight_cache"] == want
    with pytest.raises(ampfx.PolicyError, match="AMPFX_WEIGHT_CACHE='sometimes': use auto, 1 or 0"):
        ampfx.convert(model, "bf16", environ={"AMPFX_WEIGHT_CACHE": "sometimes"})
    with pytest.raises(ampfx.PolicyError, match="weight_cache='yes': use True, False or 'auto'"):
        ampfx.convert(model, "bf16", weight_cache="yes")


def test_a_weight_frozen_after_conversion_no_longer_marks_the_steps():
    """The weight whose writes mark a step is the largest trained one; frozen after conversion (fine-tuning), it is
    written no more, and another trained weight marks the steps: with one micro-batch a step nothing stays cached."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDE, WIDE), nn.ReLU(), nn.Linear(WIDE, WIDE))
    amp = convert(model)
    (_, cache), = weight_cache.caches(amp)
    watched_first = cache.auto.watch.path
    model.get_submodule(watched_first.split(".")[0]).weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(4):
        step(amp, model, opt, 1)
    assert cache.auto.watch.path != watched_first
    # the frozen weight is cached (read unchanged every call), the trained one is not (written every step)
    assert [e.path for e in cache.live] == [watched_first]


def test_a_hand_written_step_through_data_is_never_read_stale():
    """A step outside torch.optim, through .data, moves no version counter: "auto" may take it for one step of
    several calls and cache, but each copy is checked against its master, so the weights trained equal those
    without a cache."""
    def hand(**options):
        torch.manual_seed(0)
        model = Block()
        amp = convert(model, **options)
        for i in range(4):
            amp(X + i).float().pow(2).mean().backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.1)
                p.grad = None
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    auto, off = hand(), hand(weight_cache=False)
    for n in off:
        torch.testing.assert_close(auto[n], off[n], rtol=1e-5, atol=1e-6)
