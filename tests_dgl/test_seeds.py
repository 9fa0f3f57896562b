"""The seed models (DGL's mixed-precision chapter and multi-GPU tutorial) convert and train through
ampfx within 1% of float32 (examples/dgl_seeds.py; shared/seeds/000 and 001)."""
import pytest
import torch

import dgl_seeds
from ampfx.ops import Category


@pytest.fixture(scope="module")
def cora_like():
    return dgl_seeds.powerlaw_graph(n=600, in_feats=100)


def assert_within_one_percent(r, n_classes):
    f, a = r["fp32"], r["ampfx"]
    assert abs(a["loss"] - f["loss"]) <= 0.01 * f["loss"], r
    assert abs(a["acc"] - f["acc"]) <= 0.01 + 1e-6, r  # test accuracy within one percentage point
    assert f["acc"] > 2.0 / n_classes, r  # it learned: at least twice chance


@pytest.mark.parametrize("name", list(dgl_seeds.SEED_MODELS))
def test_seed_model_trains_through_ampfx_like_float32(name, cora_like):
    """Same initial weights, same data, 40 epochs: final training loss within 1% and test accuracy within
    1 point of float32, with the DGL convolutions (seed 000) or NodeUpdate's linear (seed 001) in bf16."""
    assert int(cora_like.g.in_degrees().max()) > 100  # power-law: hubs
    r = dgl_seeds.compare(name, cora_like, epochs=40)
    assert_within_one_percent(r, cora_like.n_classes)
    rep = r["report"]
    low = [x for x in rep.compute if x.dtype == torch.bfloat16]
    if name.startswith(("GAT", "GCN")):
        convs = [x for x in rep.compute if x.op.startswith("dgl.")]
        assert convs and all(x.category is Category.ALLOW and x.dtype == torch.bfloat16 for x in convs)
    else:  # the root calls g.update_all: it stays eager, each NodeUpdate is converted on its own
        assert any(reg.path == "" and reg.method.startswith("eager") for reg in rep.parts)
        assert {x.op for x in low} >= {"linear"}


def test_seed_gcn_on_dgl_offline_dataset_with_float64_features():
    """BACommunity (DGL's offline synthetic dataset, float64 features made float32 for the model)."""
    data = dgl_seeds.ba_community()
    assert_within_one_percent(dgl_seeds.compare("GCN", data, epochs=60), data.n_classes)


def test_seed_gat_crashes_under_cpu_autocast_and_runs_under_ampfx(cora_like):
    """torch.autocast('cpu', bf16) hands GATConv bf16 node data and fp32 attention (DGL's autocast shim only
    checks CUDA): DGL raises. The same model through ampfx trains (above) and runs here."""
    message = dgl_seeds.autocast_crash(cora_like)
    assert "data type" in message and "doesn't match" in message, message
    r = dgl_seeds.compare("GAT heads [1,1,1]", cora_like, epochs=2)
    assert r["ampfx"]["loss"] == pytest.approx(r["fp32"]["loss"], rel=0.01)
