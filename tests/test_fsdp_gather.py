"""ampfx.integrations.fsdp in one process: which dtype each parameter is all-gathered in and why, and that a
converted module whose parameters were prepared for it trains, saves and loads as before. The two-rank runs
(bytes on the wire, float32 gradients, numerics against autocast) are in tests/distributed."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx.errors import ArgumentError
from ampfx.integrations.fsdp import LowGathered, LowShard, decide, gather_low


class Tied(nn.Module):
    """An LM head tied to its embedding (read float32 by the lookup, low by the head), a norm, a GEMM, and a
    parameter the root's graph reads through an elementwise op (a scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(F.gelu(self.fc(self.emb(idx))) * self.scale))


def _converted() -> nn.Module:
    torch.manual_seed(0)
    return ampfx.convert(Tied(), "bf16", example_inputs=(torch.randint(0, 16, (2, 5)),))


def test_each_parameter_gets_the_dtype_of_its_reads_with_the_reason():
    decisions = {d.name: d for d in decide(_converted())}
    assert list(decisions) == ["scale", "emb.weight", "fc.weight", "fc.bias", "norm.weight", "norm.bias"]
    assert decisions["fc.weight"].dtype == torch.bfloat16
    assert decisions["fc.weight"].reason == "cast to bfloat16 for linear"
    assert decisions["norm.weight"].dtype == torch.float32 and "kept float32" in decisions["norm.weight"].reason
    # tied: the lookup reads it as it is, the head low: one float32 read is enough to keep it float32
    assert decisions["emb.weight"].dtype == torch.float32 and "emb's own forward" in decisions["emb.weight"].reason
    assert decisions["scale"].dtype == torch.float32 and decisions["scale"].reason == "read as it is by mul"
    assert str(decisions["fc.bias"]) == "fc.bias: bfloat16 (cast to bfloat16 for linear)"


def test_prepared_parameters_train_as_the_converted_module_does_and_stay_tied():
    want, got = _converted(), _converted()
    gather_low(got)
    assert isinstance(got.fc.weight, LowShard) and not isinstance(got.norm.weight, LowShard)
    assert got.head.weight is got.emb.weight  # a tie is one parameter still
    idx = torch.randint(0, 16, (3, 5))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (want, got)]
    for _ in range(3):
        losses = []
        for m, opt in zip((want, got), opts):
            loss = F.cross_entropy(m(idx).float().flatten(0, 1), idx.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1]
    assert got.fc.weight.grad is None and type(got.fc.weight._tensor) is torch.Tensor
    torch.testing.assert_close(got.fc.weight._tensor, want.fc.weight.detach(), rtol=0, atol=0)


def test_a_state_dict_holds_plain_float32_tensors_and_loads_both_ways():
    amp = _converted()
    gather_low(amp)
    buf = io.BytesIO()
    torch.save(amp.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)  # weights_only: no class of ampfx's in the file
    assert {type(v) for v in state.values()} == {torch.Tensor}
    plain = _converted()
    plain.load_state_dict(state)
    with torch.no_grad():
        state["fc.weight"].add_(1.0)
    amp.load_state_dict(state)
    assert isinstance(amp.fc.weight, LowShard)
    torch.testing.assert_close(amp.fc.weight._tensor, state["fc.weight"])
    again = copy.deepcopy(amp)
    idx = torch.randint(0, 16, (2, 5))
    assert torch.equal(again(idx), amp(idx))


def test_the_gathered_parameter_is_read_low_without_a_copy_and_float32_otherwise():
    data = torch.randn(6, dtype=torch.bfloat16)
    gathered = LowGathered(data, torch.float32)
    assert gathered.dtype == torch.float32
    low = gathered.to(torch.bfloat16)
    assert low.data_ptr() == data.data_ptr() and type(low) is torch.Tensor
    assert torch.equal(gathered * 2, data.float() * 2)  # any other op: float32 of the gathered values
    view = gathered.view(2, 3)
    assert type(view) is LowGathered and view.to(torch.bfloat16).data_ptr() == data.data_ptr()
    param = nn.Parameter(LowGathered(data, torch.float32))  # as FSDP2 holds it: a leaf autograd steps through
    read = ampfx.runtime.cast(param, torch.bfloat16)
    assert read.data_ptr() == data.data_ptr() and read.grad_fn is not None
    (read.float() * 2).sum().backward()
    assert type(param.grad) is torch.Tensor and param.grad.dtype == torch.float32  # reduce-scattered so


def test_the_shard_casts_itself_for_the_all_gather():
    shard = LowShard(torch.randn(4), torch.bfloat16)
    (sent,), meta = shard.fsdp_pre_all_gather(None, torch.Size([8]), (1,), nn.Linear(1, 1), None)
    assert sent.dtype == torch.bfloat16 and meta is None
    padded = F.pad(shard, (0, 2))  # FSDP2 pads a shard with ops that keep it a shard
    assert type(torch.chunk(shard, 2)[0]) is LowShard and padded.shape == (6,)
    gathered, inner = shard.fsdp_post_all_gather((sent,), None, torch.float32)
    assert type(gathered) is LowGathered and inner == (sent,)
    assert shard.fsdp_post_all_gather((sent,), None, torch.float32, out=gathered) is None


def test_bad_inputs_are_refused_with_the_fix():
    with pytest.raises(ArgumentError, match="module ampfx.convert returned; got Linear"):
        gather_low(nn.Linear(2, 2))
    amp = _converted()
    assert gather_low(amp) == gather_low(amp)  # twice: the same decisions, nothing wrapped twice
    assert type(amp.fc.weight._tensor) is torch.Tensor


class ByMode(nn.Module):
    """A weight that a GEMM reads in training and an elementwise op in evaluation."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w) if self.training else x * self.w[0]


def test_the_other_training_modes_reads_count_too():
    """The training graph reads the weight only through a cast to bf16; the evaluation graph (made when decide asks
    for it) reads it as it is: it is gathered float32."""
    from ampfx.integrations.fsdp import _reads

    amp = ampfx.convert(ByMode().train(), "bf16", example_inputs=(torch.randn(2, 4),))
    assert [(is_low, why) for _, is_low, why in _reads(amp, torch.bfloat16)] == [(True, "cast to bfloat16 for linear")]
    (decision,) = decide(amp)
    assert decision.dtype == torch.float32 and decision.reason == "read as it is by getitem", decision


class Normed(nn.Module):
    """A weight-normed Linear (a leaf run low, whose parametrization computes its weight in float32) and a plain
    one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.utils.parametrizations.weight_norm(nn.Linear(16, 16))
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.fc(x))


class Branchy(nn.Module):
    """A tied LM whose root keeps its Python (a branch on a value): its embedding runs as it is, read float32."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.body, self.head = nn.Embedding(32, 16), nn.Linear(16, 16), nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        if h.sum().item() > -1e9:
            h = self.body(h)
        return self.head(h)


def test_parameters_a_parametrization_or_the_models_own_python_reads_stay_float32():
    normed = {d.name: d for d in decide(ampfx.convert(Normed(), "bf16", example_inputs=(torch.randn(4, 16),)))}
    assert normed["lin.weight"].dtype == torch.bfloat16
    for name in ("fc.parametrizations.weight.original0", "fc.parametrizations.weight.original1"):
        assert normed[name].dtype == torch.float32 and "parametrization" in normed[name].reason, normed[name]
    amp = ampfx.convert(Branchy(), "bf16", example_inputs=(torch.randint(0, 32, (2, 5)),), tracer="fx")
    branchy = {d.name: d for d in decide(amp)}
    assert branchy["emb.weight"].dtype == torch.float32, branchy["emb.weight"]  # the head reads it low
    assert branchy["emb.weight"].reason.startswith("read by emb's own Python")
    assert branchy["body.weight"].dtype == torch.bfloat16


def test_a_parameter_held_in_a_low_dtype_is_gathered_as_it_is():
    net = nn.Sequential(nn.Linear(4, 4))
    net.register_parameter("table", nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)))
    amp = ampfx.convert(net, "bf16", example_inputs=(torch.randn(2, 4),))
    table = {d.name: d for d in gather_low(amp)}["table"]
    assert table.dtype == torch.bfloat16 and table.reason.startswith("held in")
    assert type(amp.table) is nn.Parameter and isinstance(net[0].weight, LowShard)
