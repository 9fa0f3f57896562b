"""The distributed lane (issue #14): a converted model under DDP, FSDP2 per block + root (with and
without MixedPrecisionPolicy), activation checkpointing per block + DDP, on 2 gloo ranks on CPU, each
with the same gradients as the converted model in one process; torch.compile in one process.
Every collective times out and every wait has a deadline (harness.run)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402
import workers  # noqa: E402

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")]


@pytest.fixture(scope="module")
def reference():
    return workers.reference()


@pytest.fixture(scope="module")
def stepped():
    """``stepped(how)``: each rank's result of one step wrapped as ``how`` (run once per module)."""
    runs = {}

    def get(how: str) -> list:
        if how not in runs:
            runs[how] = harness.run(workers.step, how)
        return runs[how]
    return get


def _close(got: dict, want: dict, rtol: float) -> None:
    assert got.keys() == want.keys()
    for name, g in want.items():
        err = (got[name] - g).norm() / max(g.norm(), 1e-6)
        assert err < rtol, (name, float(err))


@pytest.mark.parametrize("how", ["ddp", "fsdp", "ac_ddp"])
def test_gradients_equal_the_single_process_run(how, reference, stepped):
    loss, grads = reference
    ranks = stepped(how)
    for r in ranks:
        assert abs(r["loss"] - loss) < 1e-3 * max(1.0, abs(loss))
        _close(r["grads"], grads, 2e-2)  # bf16: the ranks' sums round differently than one batch's
        assert r["fired"] >= 1  # a forward hook on a kept block fires under every wrapper
        assert r["masters"] == {torch.float32}
        # the weight cache (asked for but by plain DDP's run): used under DDP (its gradients take the ordinary
        # path), off where FSDP2 shards
        if how == "ddp":
            assert len(r["cache"]) == 1 and r["cache"][0].startswith("no weight cache"), r["cache"]
            continue
        assert len(r["cache"]) == 5 and all((": on," in line) == (how != "fsdp") for line in r["cache"]), r["cache"]
        assert how != "fsdp" or all("off: FSDP2" in line for line in r["cache"])


@pytest.mark.parametrize("how", ["ddp", "fsdp", "ac_ddp"])
def test_fp8_linears_train_under_each_wrapper_as_in_one_process(how, stepped):
    """fp8= under DDP, FSDP2 per block + root and activation checkpointing + DDP: the FP8 linears run, the masters
    stay float32, and loss and gradients are those of the converted model's step in one process on each rank's half
    of the batch in turn (each rank scales its half by its own amax)."""
    loss, grads = workers.reference(halves=2, **workers.FP8)
    for r in stepped("fp8_" + how):
        assert r["fp8_linears"] == 15  # 4 blocks x 4 linears and the head, less the first (blocks.0.qkv) and the head
        assert abs(r["loss"] - loss) < 2e-2 * max(1.0, abs(loss))
        _close(r["grads"], grads, 2e-2)  # the ranks' sums round differently
        assert r["masters"] == {torch.float32}


def test_fsdp_mixed_precision_gathers_half_the_bytes(reference, stepped):
    loss, grads = reference
    full, mixed = stepped("fsdp"), stepped("fsdp_mp")
    for r in mixed:
        assert abs(r["loss"] - loss) < 2e-2 * max(1.0, abs(loss))
        _close(r["grads"], grads, 5e-2)
        assert r["masters"] == {torch.float32} and r["grad_dtypes"] == {"torch.float32"}
        assert all("off: FSDP2 shards the module" in line for line in r["cache"]), r["cache"]
    ratio = mixed[0]["gathered"] / full[0]["gathered"]
    assert 0.45 < ratio < 0.55, ratio  # bfloat16 parameters all-gathered: half of float32's bytes
    assert mixed[0]["scattered"] == full[0]["scattered"]  # gradients reduced in float32 both ways


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_fsdp_gathers_each_weight_in_the_dtype_the_plan_reads_it_in(reference, stepped):
    """gather_low: weights only low ops read cross the wire in bf16, norms and embeddings in float32; the gradients
    are float32 and reduced so, and the step is the converted model's own in one process, within the rounding of
    the ranks' sums: so output and gradient errors against float32 are no worse than autocast's."""
    loss, grads = reference
    full, mixed, low = stepped("fsdp"), stepped("fsdp_mp"), stepped("fsdp_low")
    for r in low:
        assert abs(r["loss"] - loss) < 1e-3 * max(1.0, abs(loss))
        _close(r["grads"], grads, 2e-2)
        assert r["masters"] == {torch.float32} and r["grad_dtypes"] == {"torch.float32"}
        assert r["scattered"] == full[0]["scattered"]  # gradients reduce-scattered in float32
    gather = dict(line.split(": ", 1) for line in low[0]["gather"])
    assert gather["blocks.0.qkv.weight"].startswith("bfloat16 (cast to bfloat16 for linear")
    assert gather["blocks.2.ln1.weight"].startswith("float32 (read in float32 by ln1")
    assert gather["wte.weight"].startswith("float32") and gather["head.weight"].startswith("bfloat16")
    # bytes: the float32 islands' share over bf16 for everything, half of float32 for the rest
    floats = sum(1 for v in gather.values() if v.startswith("float32"))
    assert 0 < floats < len(gather)
    assert mixed[0]["gathered"] < low[0]["gathered"] < 0.55 * full[0]["gathered"]
    # numerics: against float32 in one process, no worse than autocast's
    ref = workers.float32_and_autocast()
    logits = torch.cat([r["logits"] for r in low])
    want_logits, want_grads = ref["float32"]
    auto_logits, auto_grads = ref["autocast"]
    assert _error(logits, want_logits) <= _error(auto_logits, want_logits)
    total = sum(_error(g, want_grads[k]) for k, g in low[0]["grads"].items())
    assert total <= sum(_error(g, want_grads[k]) for k, g in auto_grads.items())


def test_fsdp_low_gather_trains_as_the_float32_gather_does_and_saves_float32():
    """Three AdamW steps: the same losses as gathering float32 (the graph casts the same weights to bf16 either
    way), at about half the bytes every step; the full state dict holds plain float32 tensors."""
    full = harness.run(workers.train, "fsdp")
    low = harness.run(workers.train, "fsdp_low")
    for f, r in zip(full, low):
        assert r["losses"] == pytest.approx(f["losses"], rel=1e-5)
        assert all(g < 0.55 * fg for g, fg in zip(r["gathered"], f["gathered"]))
        assert r["state"].keys() == f["state"].keys()
        for key, (kind, dtype, value) in r["state"].items():
            assert (kind, dtype) == ("Tensor", torch.float32), key
            torch.testing.assert_close(value, f["state"][key][2], rtol=1e-5, atol=1e-6)


def _raises(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one fails")
    torch.distributed.barrier()  # rank 0 waits for a rank that is gone: the collective times out


def test_a_failing_rank_fails_the_test_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(harness.RankFailed, match="rank one fails"):
        harness.run(_raises, deadline=60, collective_timeout=10)
    assert time.monotonic() - start < 90


def test_compile_of_the_converted_model():
    amp = workers.converted()
    idx, target = workers.data()
    want = workers.loss_of(amp, idx, target)
    want.backward()
    grads = workers.full_grads(amp)
    amp.zero_grad()
    compiled = torch.compile(amp)  # inductor on CPU (slow: one tiny model)
    got = workers.loss_of(compiled, idx, target)
    got.backward()
    assert abs(got.item() - want.item()) < 1e-2
    _close(workers.full_grads(amp), grads, 2e-2)


def test_every_rank_plans_from_rank_zeros_measured_table(tmp_path):
    """Rule: in a run of several processes the device's table is rank 0's, broadcast at its first need: ranks that
    measured differently still make the same plan (FSDP2's gathers follow it)."""
    results = harness.run(workers.plan_from_rank_zero, str(tmp_path))
    assert results[0]["rules"] == results[1]["rules"] == ["table", "table"]
    assert all("rank 0's" in r["source"] for r in results)


def test_a_rank_that_converts_alone_does_not_hang(tmp_path):
    """Rule: the table passes through the process group's store, not a collective: a rank converting alone never
    waits on the others' collective; rank 1 without rank 0's table uses its own after a while, and says so."""
    results = harness.run(workers.convert_alone, str(tmp_path), deadline=120.0)
    assert results[0]["said"] == [] and len(results[1]["said"]) == 1
    assert "rank 0's device-cost table did not come" in results[1]["said"][0]


def test_a_rank_whose_plan_differs_from_rank_zeros_is_refused(tmp_path):
    """Rule: in a run of several processes every conversion's plan is compared with rank 0's (ampfx.ranks): the same
    example on each rank passes; an example whose size puts a GEMM over the break-even on rank 0 only makes rank 1
    raise PlanMismatchError, naming the node, both dtypes and the fix, instead of training apart."""
    results = harness.run(workers.plans_compared, str(tmp_path), deadline=120.0)
    assert results[0]["error"] is None
    said = results[1]["error"]
    assert said is not None and "rank 1 converted Sequential to another plan than rank 0" in said
    assert "runs in float32 on rank 1, in bfloat16 on rank 0" in said and "example inputs of the same sizes" in said


def test_ranks_that_convert_models_of_their_own_compare_only_the_models_they_share():
    """Rule: conversions are paired by the model's fingerprint: a pipeline stage only one rank converts is not
    compared with another rank's stage (rank 1 waits once for it, and says so once), and the model both convert is
    compared with no error."""
    results = harness.run(workers.plans_of_other_models, deadline=120.0)
    assert results[0]["said"] == []
    assert len(results[1]["said"]) == 1 and "rank 1 could not compare its plan of Sequential" in results[1]["said"][0]
