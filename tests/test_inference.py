"""mode="inference": weights of low-precision ops stored low once; outputs as in train mode."""
import copy

import pytest
import torch
import torch.nn as nn

import ampfx
from support.models import MODELS, build


@pytest.mark.parametrize("name", MODELS)
def test_inference_mode_matches_train_mode_and_stores_weights_low(name):
    m, ex, _ = build(name)
    m.eval()
    train = ampfx.convert(m, "bf16", example_inputs=ex, weight_cache=False).eval()  # casts its weights per call
    infer = ampfx.convert(m, "bf16", example_inputs=ex, mode="inference").eval()
    with torch.no_grad():
        torch.testing.assert_close(infer(*ex), train(*ex), rtol=0, atol=0)
        per_call = ampfx.count_casts(lambda: infer(*ex))
        assert per_call < ampfx.count_casts(lambda: train(*ex))
    assert [id(p) for p in infer.parameters()] == [id(p) for p in m.parameters()], "the model's own parameters"
    assert all(p.dtype == torch.float32 for p in m.parameters()), "the model itself is unchanged"
    assert any("inference mode" in n and "bytes beside" in n for n in infer.ampfx_report.notes)


def test_norm_and_embedding_parameters_stay_fp32():
    """Only weights every use of which is a low op get low copies: norms and embeddings are read float32."""
    m, ex, _ = build("transformer")
    infer = ampfx.convert(m, "bf16", example_inputs=ex, mode="inference")
    copied = [e.path for e in infer._rt.weights.entries]
    assert "head.weight" in copied and not any(p.startswith(("norm.", "emb.")) for p in copied)


def test_bad_mode_is_an_error():
    with pytest.raises(ampfx.PolicyError, match="mode='eval'"):
        ampfx.convert(nn.Linear(2, 2), "bf16", mode="eval")


def _members(n: int = 3) -> list[nn.Module]:
    return [build("mlp", seed=s)[0].eval() for s in range(n)]


def test_a_torch_func_ensemble_runs_as_each_member_separately():
    """Rule: an inference-mode conversion runs in a ``torch.func`` ensemble (``stack_module_state``, then
    ``torch.vmap`` over ``functional_call``): the batched tensors in the parameters' places, whose writes no
    stamp can see, are cast by the graph at the call, as in training mode (bitwise its result, and each member's
    own conversion's within bfloat16 rounding), and the copies of the model's own weights are kept."""
    members = _members()
    x = build("mlp")[1][0]
    infer = ampfx.convert(members[0], "bf16", example_inputs=(x,), mode="inference").eval()
    train = ampfx.convert(members[0], "bf16", example_inputs=(x,), weight_cache=False).eval()
    params, buffers = torch.func.stack_module_state(members)

    def ensemble(amp):
        return torch.vmap(lambda p, b: torch.func.functional_call(amp, (p, b), (x,)))(params, buffers)

    with torch.no_grad():
        alone = [ampfx.convert(m, "bf16", example_inputs=(x,), mode="inference").eval()(x) for m in members]
        infer(x)  # (converting members[0] again wrote its weights back: this call copies them)
        own, reused = infer(x), ampfx.count_casts(lambda: infer(x))
        got = ensemble(infer)
        torch.testing.assert_close(got, ensemble(train), rtol=0, atol=0)
        for i in range(len(members)):
            torch.testing.assert_close(got[i], alone[i], rtol=2 ** -7, atol=1e-2)
        assert ampfx.count_casts(lambda: infer(x)) == reused < ampfx.count_casts(lambda: train(x)), "copies kept"
        torch.testing.assert_close(infer(x), own, rtol=0, atol=0)
    lows = [v for k, v in infer.__dict__.items() if k.startswith("_ampfx_low")]
    assert lows and all(type(v) is torch.Tensor and v.dtype == torch.bfloat16 for v in lows)
    assert not any(torch._C._functorch.is_functorch_wrapped_tensor(v) for v in lows), "no batched tensor held"
    copy.deepcopy(infer)


def test_torch_func_grad_over_functional_call_reaches_the_values_given():
    """Rule: a value given for one call in a parameter's place (``functional_call``'s, wrapped by
    ``torch.func.grad``) is cast by the graph at that call, so its gradient reaches it: the gradients equal
    training mode's (a kept low copy would cut them to zero)."""
    model, (x,), _ = build("mlp")
    params = {k: v.detach() for k, v in model.named_parameters()}

    def grads(amp):
        return torch.func.grad(lambda p: torch.func.functional_call(amp, p, (x,)).float().square().sum())(params)

    got = grads(ampfx.convert(model, "bf16", example_inputs=(x,), mode="inference"))
    want = grads(ampfx.convert(model, "bf16", example_inputs=(x,), weight_cache=False))
    assert all(g.abs().sum() > 0 for g in want.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_functional_call_with_plain_tensors_leaves_the_models_copies_in_place():
    """Rule: ``functional_call`` with plain tensors (no transform) computes with those tensors, bitwise as
    training mode does, holds none of them after the call, and the next plain call reuses the copies of the
    model's own weights (no weight cast)."""
    model, (x,), _ = build("mlp")
    infer = ampfx.convert(model, "bf16", example_inputs=(x,), mode="inference").eval()
    train = ampfx.convert(model, "bf16", example_inputs=(x,), weight_cache=False).eval()
    other = {k: torch.randn_like(v) for k, v in model.named_parameters()}
    with torch.no_grad():
        own = infer(x)
        reused = ampfx.count_casts(lambda: infer(x))
        got = torch.func.functional_call(infer, other, (x,))
        torch.testing.assert_close(got, torch.func.functional_call(train, other, (x,)), rtol=0, atol=0)
        assert not torch.equal(got, own)
        assert ampfx.count_casts(lambda: infer(x)) == reused
        torch.testing.assert_close(infer(x), own, rtol=0, atol=0)
    held = {id(v) for v in infer.__dict__.values()} | {id(e.master) for e in infer._rt.weights.entries}
    assert not held & {id(v) for v in other.values()}


def test_the_plans_table_of_reads_follows_the_copies_inference_mode_reads():
    """Rule: where inference mode makes the graph read a low copy in place of a parameter, the plan's table of
    parameter reads says so (the parameter is read by no graph), as the graph does: FSDP2's gather dtype, which
    reads the table, gathers those in float32."""
    from ampfx.integrations.fsdp import decide
    from ampfx.runtime.reads import reads

    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), nn.LayerNorm(4))
    x = torch.randn(4, 8)
    train = ampfx.convert(m, "bf16", example_inputs=(x,), gemm_min_flops=0)
    infer = ampfx.convert(m, "bf16", example_inputs=(x,), gemm_min_flops=0, mode="inference")
    assert {r.path for r in reads(train, torch.bfloat16) if r.how == "cast"} >= {"0.weight", "2.weight"}
    copied = {e.path for e in infer._rt.weights.entries}
    assert {"0.weight", "2.weight"} <= copied
    assert not copied & {r.path for r in reads(infer, torch.bfloat16)}
    assert {d.name: d.dtype for d in decide(infer)}["0.weight"] == torch.float32


class _Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.double = nn.Linear(16, 16), True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 2 if self.double else self.fc(x)


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_a_conversion_made_again_at_a_call_keeps_the_weight_copies_of_the_first(mode):
    """Rule: a graph module converted again at a call (a Python flag its graph fixed changed) is armed as the first
    conversion was: the training weight cache (``weight_cache=True``), or inference mode's low copies."""
    m, x = _Flagged(), torch.randn(4, 16)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,), gemm_min_flops=0, mode=mode, weight_cache=True)
    assert amp._rt.weights is not None and amp._rt.weights.reads_copies == (mode == "inference")
    m.double = False
    with torch.no_grad():
        out = amp(x)
    made = amp.variants()
    assert len(made) == 1 and made[0]._rt.weights.reads_copies == (mode == "inference")
    with torch.no_grad():
        assert torch.equal(out, ampfx.convert(m, "bf16", example_inputs=(x,), gemm_min_flops=0, mode=mode)(x))


def test_a_pickle_from_before_the_weight_cache_kept_inference_copies_loads_them_into_it():
    """Rule: a runtime state pickled when inference copies were kept apart from the weight cache (a ``low`` step
    holding ``LowCopies``) loads as the weight cache that reads them, and a weight written after loading is copied
    again at the next call (never left stale)."""
    from ampfx.runtime.entries import Runtime
    from ampfx.runtime.inference import LowCopies

    m, (x,), _ = build("mlp")
    infer = ampfx.convert(m, "bf16", example_inputs=(x,), gemm_min_flops=0, mode="inference").eval()
    cache = infer._rt.weights
    legacy = LowCopies.__new__(LowCopies)
    legacy.__setstate__({"dtype": torch.bfloat16, "paths": [e.path for e in cache.entries],
                         "entries": [[e.owner, e.name, e.attr, None, None] for e in cache.entries]})
    loaded = Runtime.__new__(Runtime)
    loaded.__setstate__({**infer._rt.__dict__, "weights": None, "low": legacy})
    assert "low" not in loaded.__dict__ and loaded.weights.reads_copies
    assert [(e.path, e.attr) for e in loaded.weights.entries] == [(e.path, e.attr) for e in cache.entries]
    infer.__dict__["_ampfx_runtime"] = loaded
    with torch.no_grad():
        next(m.parameters()).mul_(3)
        want = ampfx.convert(m, "bf16", example_inputs=(x,), gemm_min_flops=0, weight_cache=False).eval()(x)
        torch.testing.assert_close(infer(x), want, rtol=0, atol=0)
