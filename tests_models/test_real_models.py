"""Real models from torchvision, timm, transformers and torch.nn convert and train.

Each test builds a small model from a config (random init), converts it with
example inputs, and checks: the eval output is close to float32, one training
step through the converted module moves the original float32 parameters as a
float32 step does, a step makes fewer casts than ``torch.autocast``, and the
report names the modules the decisions were made in.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from conftest import assert_trains_like_fp32, run

B, S, V, NC = 2, 16, 1000, 10
gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731


def by_module(report, op=None):
    return {r.module: r for r in report.compute if op is None or r.op == op}


# ---------------------------------------------------------------- torchvision / timm (batch-norm CNN, ViT)

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torchvision_resnet18(dtype):
    tvm = pytest.importorskip("torchvision.models")
    model = tvm.resnet18(num_classes=NC)
    g = gen()
    x = torch.randn(4, 3, 64, 64, generator=g)  # smaller: batch norm over 2 values in layer4, all noise
    y = torch.randint(0, NC, (4,), generator=g)
    o = run(model, (x,), lambda out: F.cross_entropy(out.float(), y), dtype)

    assert o.rel_err < (0.05 if dtype is torch.bfloat16 else 0.01)
    assert o.casts_autocast is not None and o.casts_ampfx < o.casts_autocast
    assert_trains_like_fp32(o)
    convs = by_module(o.report, "conv2d")
    assert convs["layer1.0.conv1"].dtype == dtype and convs["conv1"].dtype == dtype
    assert len(convs) == 20 and all(r.dtype == dtype for r in convs.values())
    assert o.report.parts[0].method.startswith("fx")
    # batch-norm statistics: float32 buffers, updated by the converted module's training steps
    bn = model.layer1[0].bn1
    assert bn.running_mean.dtype == torch.float32 and bn.num_batches_tracked.item() >= 1


def test_batchnorm_statistics_update_as_in_eager():
    """Running statistics stay float32 buffers of the original model and move as
    under float32 eager (as close as autocast's)."""
    tvm = pytest.importorskip("torchvision.models")
    import ampfx

    model = tvm.resnet18(num_classes=NC).train()
    fp32, autocast = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(4, 3, 64, 64, generator=gen())
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(x,))
    amp(x)
    fp32(x)
    with torch.autocast("cpu", torch.bfloat16):
        autocast(x)
    ours, ref, theirs = dict(model.named_buffers()), dict(fp32.named_buffers()), dict(autocast.named_buffers())
    assert ours["layer1.0.bn1.num_batches_tracked"].item() == 1
    for name, buf in ours.items():
        assert buf.dtype == ref[name].dtype, name
        if buf.dtype == torch.float32:
            initial = torch.ones_like(buf) if name.endswith("running_var") else torch.zeros_like(buf)
            assert not torch.equal(buf, initial), f"{name} did not move"
            err = (buf - ref[name]).norm() / ref[name].norm()
            err_autocast = (theirs[name] - ref[name]).norm() / ref[name].norm()
            assert err <= max(0.01, 1.25 * err_autocast), (name, float(err), float(err_autocast))


def test_timm_vit_tiny():
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=NC, img_size=32)
    g = gen()
    x = torch.randn(B, 3, 32, 32, generator=g)
    y = torch.randint(0, NC, (B,), generator=g)
    o = run(model, (x,), lambda out: F.cross_entropy(out.float(), y))

    assert o.rel_err < 0.05
    assert o.casts_ampfx < o.casts_autocast
    assert_trains_like_fp32(o)
    mods = {(r.module, r.op): r for r in o.report.compute}
    assert mods[("blocks.0.attn.qkv", "linear")].dtype == torch.bfloat16
    # layer_norm is on the infer list (its kernel keeps statistics in float32): it follows its neighbours
    assert mods[("blocks.0.norm1", "layer_norm")].rule.startswith(("paint:", "fidelity:"))  # norm1 reads the float32 stream
    assert mods[("head", "linear")].dtype == torch.bfloat16
    softmaxes = [r for r in o.report.compute if r.op in ("softmax", "scaled_dot_product_attention")]
    assert softmaxes and all(r.module.startswith("blocks.") for r in softmaxes)


# ---------------------------------------------------------------- HF transformers (attention, embeddings)

def _ids_and_mask():
    g = gen()
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -4:] = 0
    return ids, mask


def assert_captured_whole(report):
    """One graph for the whole model (fx, or torch.export where fx cannot), not eager parts."""
    assert len(report.parts) == 1 and report.parts[0].method in ("fx", "export"), [
        (r.path, r.method) for r in report.parts]


def test_hf_bert_sequence_classification():
    tf = pytest.importorskip("transformers")
    cfg = tf.BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=64, num_labels=NC)
    model = tf.BertForSequenceClassification(cfg)
    ids, mask = _ids_and_mask()
    labels = torch.randint(0, NC, (B,), generator=gen())
    o = run(model, {"input_ids": ids, "attention_mask": mask, "labels": labels}, lambda out: out.loss.float())

    assert o.rel_err < 0.05
    assert o.casts_ampfx < o.casts_autocast
    assert_trains_like_fp32(o)
    assert_captured_whole(o.report)
    linears = {r.module: r for r in o.report.compute if r.op == "linear"}
    assert linears["bert.encoder.layer.0.attention.self.query"].dtype == torch.bfloat16
    assert linears["classifier"].dtype == torch.bfloat16
    embeddings = [r for r in o.report.records if r.op == "embedding"]  # gathers: PASS, not compute
    assert {r.module for r in embeddings} >= {"bert.embeddings.word_embeddings"}
    losses = [r for r in o.report.compute if r.op == "cross_entropy"]
    assert losses and all(r.dtype == torch.float32 for r in losses)


def test_hf_gpt2_lm():
    tf = pytest.importorskip("transformers")
    cfg = tf.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=2, n_positions=64)
    model = tf.GPT2LMHeadModel(cfg)
    ids, mask = _ids_and_mask()
    o = run(model, {"input_ids": ids, "attention_mask": mask, "labels": ids, "use_cache": False},
            lambda out: out.loss.float())

    assert o.rel_err < 0.05
    # the residual stream stays float32 as under autocast; CPU autocast runs softmax low (#15)
    assert o.casts_ampfx <= o.casts_autocast, (o.casts_ampfx, o.casts_autocast)
    assert_trains_like_fp32(o)
    assert_captured_whole(o.report)
    recs = {(r.module, r.op): r for r in o.report.compute}
    # GPT-2's projections are Conv1D modules: addmm on a transposed layout
    assert any(m.startswith("transformer.h.0.attn") and r.dtype == torch.bfloat16 for (m, _), r in recs.items())
    assert ("transformer.h.1.ln_2", "layer_norm") in recs
    softmaxes = [r for r in o.report.compute if r.op == "softmax"]
    assert all(r.dtype == torch.float32 for r in softmaxes)


def _hf_decoder(kind: str):
    tf = pytest.importorskip("transformers")
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=2, n_positions=64,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_decoder_lms_train_compiled_after_convert(kind):
    """Rule: convert, then torch.compile, trains an HF decoder LM whose graph holds its vmapped attention masks
    (torch.export writes torch.vmap as calls that open and close a level; dynamo refused them on its fake
    tensors: NYI querying is_contiguous inside of vmap). Each level runs as one eager call
    (ampfx.passes.transforms): the compiled step's loss and gradients are the eager converted step's, and the
    converted module still pickles (unpickling re-traced those calls on proxies and raised)."""
    import pickle

    torch.manual_seed(0)
    model = _hf_decoder(kind)
    ids, mask = _ids_and_mask()
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids, "use_cache": False}
    amp = ampfx.convert(model, "bf16", example_inputs=inputs)
    assert any(n.name.startswith("eager_region") for n in amp.graph.nodes), "no vmap level in the graph"
    eager = amp(**inputs).loss.float()
    eager.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(amp, backend="aot_eager")(**inputs).loss.float()
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=1e-3)
    for n, g in want.items():
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, g, rtol=0.02, atol=1e-3)
    loaded = pickle.loads(pickle.dumps(amp))
    torch.testing.assert_close(loaded(**inputs).loss.float(), eager, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------- torch.nn RNN

class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        self.lstm = nn.LSTM(32, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, NC)

    def forward(self, ids):
        h, _ = self.lstm(self.emb(ids))
        return self.head(h[:, -1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lstm_classifier(dtype):
    model = LSTMClassifier()
    ids, _ = _ids_and_mask()
    y = torch.randint(0, NC, (B,), generator=gen())
    o = run(model, (ids,), lambda out: F.cross_entropy(out.float(), y), dtype)

    assert o.rel_err < (0.05 if dtype is torch.bfloat16 else 0.01)
    assert_trains_like_fp32(o)
    lstm = by_module(o.report)["lstm"]
    if o.casts_autocast is not None:  # torch.autocast("cpu", float16) fails on LSTM on some CPUs
        assert o.casts_ampfx < o.casts_autocast
    # the LSTM runs low where the device's kernel works, else float32 with the probe's reason
    assert lstm.dtype == dtype or (lstm.rule == "probe" and "LSTM" in lstm.reason + lstm.op.upper())


def test_timm_drop_path_is_one_dropout_node_not_its_body():
    """timm's drop_path is in the tables by qualified name; the tracer keeps it
    whole, so its random mask is not made in float32 and cast every block."""
    timm = pytest.importorskip("timm")
    import ampfx

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=NC, img_size=32,
                              drop_path_rate=0.1, depth=2)
    x = torch.randn(B, 3, 32, 32, generator=gen())
    amp = ampfx.convert(model.train(), torch.bfloat16, example_inputs=(x,), tracer="fx")
    rep = amp.ampfx_report
    drops = [r for r in rep.compute if r.target.endswith("drop_path")]
    # rates rise linearly from 0: block 0 has none, block 1 two (attention and MLP branches)
    assert [r.module for r in drops] == ["blocks.1.drop_path1", "blocks.1.drop_path2"]
    assert all(r.op == "dropout" for r in drops)
    assert not [r for r in rep.records if "bernoulli" in r.op]
    assert not [c for c in rep.casts if not c.weight and c.value.startswith("new_empty")]
    assert amp(x).dtype == torch.float32


def test_torchvision_stochastic_depth_is_one_dropout_node():
    """torchvision fx.wrap-s stochastic_depth itself; ampfx keeping it whole too must
    still record torchvision's function (it was recorded as ampfx's wrapper,
    unlisted, and every block's residual branch stayed float32)."""
    tvm = pytest.importorskip("torchvision.models")
    import ampfx

    model = tvm.convnext_tiny(num_classes=NC, stochastic_depth_prob=0.1)
    amp = ampfx.convert(model.train(), torch.bfloat16, example_inputs=(torch.randn(1, 3, 32, 32),), tracer="fx")
    rep = amp.ampfx_report
    depth = [r for r in rep.compute if "stochastic_depth" in r.target]
    # each follows the block's layer scale, a float32 parameter times the branch: float32, as autocast's
    # promotion computes it (fidelity:operand), so the dropout runs in float32 too, as under autocast
    assert len(depth) == 18 and all(r.op == "dropout" and r.dtype == torch.float32 for r in depth)
    assert all(r.rule != "unlisted" for r in depth)
    assert not [r for r in rep.compute if r.rule == "unlisted"]
