"""Structure edits after convert (what PEFT-style adapters and weight untying do) convert the affected graph again at
its next call, within reconvert_limit, logged and listed in variants(); the result is the edited model's."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx.errors import StaleModelError


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.q, self.out = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.out(F.gelu(self.q(self.ln(x))))


class LM(nn.Module):
    """Embedding, two blocks (kept as boundaries: a repeated block), a head tied to the embedding."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class LoRA(nn.Module):
    """A low-rank adapter around a frozen Linear, as PEFT injects it."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)
        base.requires_grad_(False)

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


IDS = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))


def close(a, b):
    torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)


def test_a_lora_wrapper_injected_after_convert_shows_through_and_trains():
    """Rule: a Linear replaced inside a kept block by a wrapper converts that block's graph again at the next
    call (not the whole model): the output is the adapted model's, the adapter's parameters get gradients and the
    frozen base's do not, and the reconversion is in the block's variants() with the change in its notes."""
    torch.manual_seed(0)
    model = LM()
    amp = ampfx.convert(model, "bf16", example_inputs=(IDS,))
    amp(IDS)
    model.blocks[0].q = LoRA(model.blocks[0].q)
    close(amp(IDS), model(IDS))
    block = amp.blocks[0]
    assert len(block.variants()) == 1 and not amp.variants() and not amp.blocks[1].variants()
    assert "model.blocks.0.q was replaced by another module (LoRA)" in block.variants()[0].ampfx_report.notes[-1]
    amp(IDS).float().square().mean().backward()
    lora = model.blocks[0].q
    assert lora.a.grad is not None and lora.b.grad is not None and lora.base.weight.grad is None
    ids = {id(p) for p in amp.parameters()}
    assert id(lora.a) in ids and id(lora.b) in ids  # an optimizer built on amp.parameters() trains the adapter
    opt = torch.optim.SGD([p for p in amp.parameters() if p.requires_grad], lr=0.1)
    opt.step()
    close(amp(IDS), model(IDS))
    assert len(block.variants()) == 1  # made once, reused


def test_untying_the_head_shows_through():
    """Rule: a tied tensor given its own copy (untied head) converts the graph that read it through one name again:
    the head then computes with its own weight, and training changes the two apart."""
    torch.manual_seed(0)
    model = LM()
    amp = ampfx.convert(model, "bf16", example_inputs=(IDS,))
    amp(IDS)
    model.head.weight = nn.Parameter(model.emb.weight.detach().clone() * 2)
    close(amp(IDS), model(IDS))
    assert len(amp.variants()) == 1 and "model.head.weight" in amp.variants()[0].ampfx_report.notes[-1]
    amp(IDS).float().square().mean().backward()
    assert model.head.weight.grad is not None and model.emb.weight.grad is not None
    assert not torch.equal(model.head.weight.grad, model.emb.weight.grad)


def test_structure_edits_count_against_the_reconvert_limit():
    """Rule: each structure edit costs a conversion from reconvert_limit, as a changed value does; past the limit
    the call raises StaleModelError naming the change."""
    torch.manual_seed(0)
    model = LM()
    amp = ampfx.convert(model, "bf16", example_inputs=(IDS,), reconvert_limit=1)
    amp(IDS)
    model.blocks[1].out = nn.Linear(16, 16)
    close(amp(IDS), model(IDS))
    model.blocks[1].out = nn.Linear(16, 16)
    with pytest.raises(StaleModelError, match=r"model\.blocks\.1\.out was replaced.*reconvert_limit=1"):
        amp(IDS)
