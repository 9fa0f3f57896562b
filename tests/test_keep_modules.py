"""Kept modules (``keep_modules``): real ``call_module`` boundaries whose forward runs, each
converted on its own, at the model's attribute paths (issue #14)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                         checkpoint_wrapper)

import ampfx
from ampfx.errors import ArgumentError
from ampfx.runtime.graph_module import AmpGraphModule
from ampfx.tools.measure import count_casts
from ampfx.errors import PolicyError


class Block(nn.Module):
    def __init__(self, d: int, p: float = 0.0) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(att))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, n: int = 3, p: float = 0.0) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(8, d)
        self.blocks = nn.ModuleList(Block(d, p) for _ in range(n))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _gpt(p: float = 0.0) -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    return GPT(p=p), torch.randint(0, 32, (2, 8))


def _grads(model: nn.Module, idx: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    torch.manual_seed(seed)
    out = model(idx)
    out.float().logsumexp(-1).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_repeated_blocks_are_kept_by_default_at_the_same_paths():
    net, idx = _gpt()
    amp = ampfx.convert(net, "bf16", example_inputs=(idx,))
    assert isinstance(amp.blocks, nn.ModuleList) and len(amp.blocks) == 3
    assert all(isinstance(b, AmpGraphModule) for b in amp.blocks)
    assert sorted(amp.state_dict()) == sorted(net.state_dict())
    assert amp.blocks[1].qkv.weight is net.blocks[1].qkv.weight  # float32 masters, shared
    calls = [n for n in amp.graph.nodes if n.op == "call_module"]
    assert [n.target for n in calls if n.target.startswith("blocks")] == ["blocks.0", "blocks.1", "blocks.2"]
    records = amp.ampfx_report.records
    kept = [r for r in records if r.rule == "keep_modules"]
    assert [r.target for r in kept] == ["blocks.0", "blocks.1", "blocks.2"]
    assert all("repeated block" in r.reason for r in kept)
    assert any(r.module.startswith("blocks.2") and r.op == "linear" for r in records)  # the block's own records
    assert {r.path for r in amp.ampfx_report.parts} >= {"", "blocks.0", "blocks.1", "blocks.2"}


def test_no_keep_traces_through_and_env_replaces_the_default():
    net, idx = _gpt()
    flat = ampfx.convert(net, "bf16", example_inputs=(idx,), keep_modules=())
    assert not any(isinstance(b, AmpGraphModule) for b in flat.blocks)
    assert not any(n.op == "call_module" and str(n.target).count(".") == 1 for n in flat.graph.nodes)
    none = ampfx.convert(net, "bf16", example_inputs=(idx,), environ={"AMPFX_KEEP_MODULES": "none"})
    assert not any(isinstance(b, AmpGraphModule) for b in none.blocks)
    one = ampfx.convert(net, "bf16", example_inputs=(idx,), environ={"AMPFX_KEEP_MODULES": "blocks.1"})
    assert [isinstance(b, AmpGraphModule) for b in one.blocks] == [False, True, False]


@pytest.mark.parametrize("entry", [Block, "test_keep_modules.Block", "blocks.*", lambda m, fqn: fqn == "blocks.0"])
def test_keep_by_class_glob_and_predicate(entry):
    net, idx = _gpt()
    amp = ampfx.convert(net, "bf16", example_inputs=(idx,), keep_modules=(entry,))
    assert isinstance(amp.blocks[0], AmpGraphModule)


def test_a_keep_entry_that_matches_nothing_is_an_error():
    net, idx = _gpt()
    with pytest.raises(PolicyError, match=r"keep_modules / AMPFX_KEEP_MODULES: the glob 'block.\*' matches no module"):
        ampfx.convert(net, "bf16", example_inputs=(idx,), keep_modules=("block.*",))
    with pytest.raises(PolicyError, match="keep_modules: a module object"):
        ampfx.Policy(keep_modules=(net.blocks[0],))


def test_forward_hooks_on_kept_modules_fire():
    net, idx = _gpt()
    seen_before = []
    net.ln_f.register_forward_hook(lambda m, a, out: seen_before.append(out.shape))  # a hooked module is kept
    amp = ampfx.convert(net, "bf16", example_inputs=(idx,))
    seen_before.clear()  # conversion ran the model
    seen_after = []
    amp.blocks[1].register_forward_hook(lambda m, a, out: seen_after.append(out.dtype))
    amp(idx)
    assert seen_before == [torch.Size([2, 8, 16])] and len(seen_after) == 1
    assert isinstance(amp.blocks[1], AmpGraphModule)


@pytest.mark.parametrize("inputs", [True, False])
@pytest.mark.parametrize("hooks", ["post", "pre", "pre+post"])
def test_hooks_on_a_leaf_fire_on_every_call_with_the_right_values(hooks, inputs):
    """A hooked nn.Linear with no children is kept too: its hooks fire once per call of the converted
    model (not once at conversion), a post-hook's change of the output is applied once, and a user's
    pre-hook keeps the module's Python, so float32 crosses that boundary (its forward was written for it)."""
    torch.manual_seed(0)
    net, x, calls = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)), \
        torch.randn(5, 4), []
    if "pre" in hooks:
        net[2].register_forward_pre_hook(lambda m, a: (calls.append(("pre", a[0].dtype)), (a[0] * 2,))[1])
    if "post" in hooks:
        net[2].register_forward_hook(lambda m, a, out: (calls.append(("post", out.dtype)), out * 3 + 1)[1])
    amp = ampfx.convert(net, "bf16", example_inputs=(x,) if inputs else None)
    calls.clear()
    out = amp(x)
    low = "pre" not in hooks
    assert [c for c, _ in calls] == [c for c in ("pre", "post") if c in hooks]
    assert {d for _, d in calls} == {torch.bfloat16 if low else torch.float32}
    ref = net(x)
    assert (out - ref).norm() / ref.norm() < 0.02
    kept = [r for r in amp.ampfx_report.records if r.rule == "keep_modules"]
    assert [r.target for r in kept] == ["2"] and kept[0].dtype == (torch.bfloat16 if low else torch.float32)


def test_pruning_and_weight_norm_pre_hooks_do_not_keep_their_module():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    torch.nn.utils.prune.l1_unstructured(net[0], "weight", 0.5)
    with pytest.warns(FutureWarning):
        torch.nn.utils.weight_norm(net[2])
    amp = ampfx.convert(net, "bf16", example_inputs=(torch.randn(5, 4),))
    assert not [r for r in amp.ampfx_report.records if r.rule == "keep_modules"]


def test_boundary_dtype_is_the_painted_dtype_and_the_block_returns_it():
    net, idx = _gpt()
    amp = ampfx.convert(net, "bf16", example_inputs=(idx,))
    kept = {r.node: r for r in amp.ampfx_report.records if r.rule == "keep_modules"}
    got = []
    for b in amp.blocks:
        b.register_forward_hook(lambda m, a, out: got.append((a[0].dtype, out.dtype)))
    amp(idx)
    assert [(kept[f"blocks_{i}"].dtype,) * 2 for i in range(3)] == got


def test_kept_blocks_cost_no_more_casts_than_tracing_through():
    net, idx = _gpt()
    kept = ampfx.convert(net, "bf16", example_inputs=(idx,))
    flat = ampfx.convert(net, "bf16", example_inputs=(idx,), keep_modules=())
    steps = []
    for m in (kept, flat):  # each a first step: .grad None, the weights' copies not made yet
        net.zero_grad(set_to_none=True)
        steps.append(count_casts(lambda m=m: m(idx).float().sum().backward()))
    assert steps[0] <= steps[1], steps
    ref = net(idx)
    for m in (kept, flat):
        assert (m(idx).float() - ref).abs().max() < 0.1


def test_a_module_called_twice_crosses_in_float32():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(16) for _ in range(2))

        def forward(self, x):
            return self.blocks[1](self.blocks[0](self.blocks[0](x)))

    torch.manual_seed(0)
    amp = ampfx.convert(Twice(), "bf16", example_inputs=(torch.randn(2, 8, 16),))
    twice = [r for r in amp.ampfx_report.records if r.rule == "keep_modules" and r.target == "blocks.0"]
    assert len(twice) == 2 and all(r.dtype == torch.float32 and "more than once" in r.reason for r in twice)


def test_checkpointing_kept_blocks_after_convert_gives_the_same_gradients_with_dropout():
    net, idx = _gpt(p=0.2)
    amp = ampfx.convert(net, "bf16", example_inputs=(idx,))
    out, grads = _grads(amp, idx)
    blocks = set(amp.blocks)
    apply_activation_checkpointing(amp, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: m in blocks)
    assert type(amp.blocks[0]).__name__ == "CheckpointWrapper"
    out2, grads2 = _grads(amp, idx)
    grads2 = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in grads2.items()}
    assert torch.equal(out, out2)
    assert grads.keys() == grads2.keys() and all(torch.equal(grads[k], grads2[k]) for k in grads)


def test_checkpoint_wrappers_before_convert_are_kept_and_their_module_converted():
    net, idx = _gpt(p=0.2)
    amp = ampfx.convert(net, "bf16", example_inputs=(idx,))
    _, want = _grads(amp, idx)
    blocks = set(net.blocks)
    apply_activation_checkpointing(net, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: m in blocks)
    wrapped = ampfx.convert(net, "bf16", example_inputs=(idx,))
    assert type(wrapped.blocks[0]).__name__ == "CheckpointWrapper"
    assert isinstance(wrapped.blocks[0]._checkpoint_wrapped_module, AmpGraphModule)
    _, got = _grads(wrapped, idx)
    strip = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in got.items()}
    assert strip.keys() == want.keys() and all(torch.equal(strip[k], want[k]) for k in want)


def test_parameters_that_arrive_low_are_used_as_they_come():
    """FSDP2's MixedPrecisionPolicy(param_dtype=bf16) hands the blocks bfloat16 parameters: low ops do
    not cast them again, float32 leaves (the norms) get float32 copies, gradients reach the low ones. (The
    parameters set on the converted module are the model's: each dtype converts a model of its own.)"""
    for dtype in (torch.bfloat16, torch.float16):
        net, idx = _gpt()
        amp = ampfx.convert(net, dtype, example_inputs=(idx,))
        ref = amp(idx)
        for block in amp.blocks:
            for module in block.modules():
                for name, p in list(module.named_parameters(recurse=False)):
                    setattr(module, name, nn.Parameter(p.detach().to(dtype)))
        out = amp(idx)
        out.float().sum().backward()
        assert (out.float() - ref.float()).abs().max() < 0.05
        assert amp.blocks[0].ln1.weight.grad.dtype == dtype


def test_wrapped_models_name_the_order_that_works():
    net, idx = _gpt()
    with pytest.raises(ArgumentError, match=r"the model is already wrapped by torch.compile.*Convert first"):
        ampfx.convert(torch.compile(net), "bf16", example_inputs=(idx,))
    net.blocks[1] = torch.compile(net.blocks[1])
    with pytest.raises(ArgumentError, match=r"model.blocks.1 is already wrapped by torch.compile"):
        ampfx.convert(net, "bf16", example_inputs=(idx,))


def test_export_tracer_says_it_inlines_kept_modules():
    net, idx = _gpt()
    amp = ampfx.convert(net, "bf16", example_inputs=(idx,), tracer="export")
    assert any("inlines modules" in n for n in amp.ampfx_report.notes)


def test_compile_of_a_kept_block():
    net, idx = _gpt()
    amp = ampfx.convert(net, "bf16", example_inputs=(idx,))
    amp.eval()
    ref = amp(idx)
    amp.blocks[0] = torch.compile(amp.blocks[0], backend="eager")
    assert torch.equal(amp(idx), ref)


class ModeBlock(nn.Module):
    """A block whose own Python reads ``self.training`` (its parent's does not)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(d, d), nn.BatchNorm1d(d)

    def forward(self, x):
        return x + F.dropout(F.relu(self.norm(self.fc(x))), 0.1, training=self.training)


class Stack(nn.Module):
    def __init__(self, block: type, d: int = 16) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(d, d), nn.Linear(d, 4)
        self.blocks = nn.ModuleList(block(d) for _ in range(3))

    def forward(self, x):
        x = self.inp(x)  # a low GEMM first: the blocks' stream is low
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_a_kept_block_that_reads_the_mode_keeps_its_boundary_dtype_in_both_modes():
    """Each kept block converts its other training mode itself (its parent reads no mode): that
    conversion crosses the boundary in the same dtype (it returned float32 to a caller reading
    bfloat16, and the head's GEMM failed in eval mode: DenseNet)."""
    torch.manual_seed(0)
    net, x = Stack(ModeBlock), torch.randn(8, 16)
    amp = ampfx.convert(net, "bf16", example_inputs=(x,), float32_stream=False)  # the stream crosses low
    got = []
    for b in amp.blocks:
        b.mode_module(False).register_forward_hook(lambda m, a, out: got.append(out.dtype))
    net.eval(), amp.eval()
    with torch.no_grad():
        assert (amp(x) - net(x)).abs().max() < 0.1 * net(x).abs().max()
    assert got == [torch.bfloat16] * 3


class Untraceable(nn.Module):
    """Python on values: neither torch.fx nor torch.export captures it."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        if float(x.detach().abs().mean()) > 1e6:  # a value steers Python
            x = x / 2
        return x + self.fc(self.norm(x))


def test_a_kept_block_that_cannot_be_captured_takes_float32_and_returns_the_boundary_dtype():
    """The block keeps its Python, written for float32: the caller's bfloat16 values are cast to float32 on
    entry and its float32 result back to bfloat16 on exit (the region's steps say so); values right. Its hooks
    see what the model's block sees (float32 in and out)."""
    torch.manual_seed(0)
    net, x = Stack(Untraceable), torch.randn(8, 16)
    amp = ampfx.convert(net, "bf16", example_inputs=(x,), float32_stream=False)  # the stream crosses low
    region = next(r for r in amp.ampfx_report.parts if r.path == "blocks.1")
    assert region.method.startswith("eager") and "cast to float32 on entry" in region.steps[-1]
    seen = []
    amp.blocks[1].register_forward_hook(lambda m, a, out: seen.append((a[0].dtype, out.dtype)))
    out = amp(x)
    assert seen == [(torch.float32, torch.float32)] and out.dtype == torch.float32
    assert (out - net(x)).abs().max() < 0.05 * net(x).abs().max()
    out.float().sum().backward()
    assert net.blocks[1].fc.weight.grad is not None


class FinfoMask(nn.Module):
    """torch.finfo of a traced dtype: torch.fx needs this module as a leaf; torch.export captures it."""

    def forward(self, x):
        return x.masked_fill(x > 3, torch.finfo(x.dtype).min)


class BlocksAndALeaf(Stack):
    def __init__(self) -> None:
        super().__init__(ModeBlock)
        self.mask = FinfoMask()

    def forward(self, x):
        return super().forward(self.mask(x))


def test_auto_kept_blocks_give_way_to_one_exported_graph_where_fx_needs_leaves():
    """torch.fx needs a leaf elsewhere in the model: the one exported graph is worth more than the auto-kept
    boundaries (each leaf would be converted on its own, with casts at its edges; EfficientViT-M0 took 764
    casts against autocast's 319): export captures it, inlining the blocks, and a note says so; blocks named
    in keep_modules stay boundaries and the torch.fx graph with leaves is kept."""
    torch.manual_seed(0)
    net, x = BlocksAndALeaf(), torch.randn(8, 16)
    amp = ampfx.convert(net, "bf16", example_inputs=(x,))
    root = next(r for r in amp.ampfx_report.parts if r.path == "")
    assert root.method == "export" and any("inlines modules" in n for n in amp.ampfx_report.notes)
    named = ampfx.convert(net, "bf16", example_inputs=(x,), keep_modules=("blocks.*",))
    root = next(r for r in named.ampfx_report.parts if r.path == "")
    assert root.method == "fx" and isinstance(named.blocks[0], AmpGraphModule)






def test_each_kept_block_runs_a_forward_of_its_own_code_for_torch_compile():
    """Every converted graph module's forward is a code object of its own: torch.compile caches compiled frames
    by code object, and when each kept block was one more entry of one shared code object, a 12-layer GPT-2-like
    model reached as block frames (after a graph break) hit dynamo's recompile limit at the 9th block and ran
    the rest uncompiled."""
    net, idx = _gpt()
    amp = ampfx.convert(net, "bf16", example_inputs=(idx,))
    graphs = [m for m in amp.modules() if isinstance(m, torch.fx.GraphModule)]
    assert len(graphs) > 1
    assert len({id(type(g).forward.__code__) for g in graphs}) == len(graphs)  # by identity, as dynamo caches
