"""mode="inference": weights of low-precision ops stored low once; outputs as in train mode."""
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
    copied = infer._rt.low.paths
    assert "head.weight" in copied and not any(p.startswith(("norm.", "emb.")) for p in copied)


def test_bad_mode_is_an_error():
    with pytest.raises(ampfx.PolicyError, match="mode='eval'"):
        ampfx.convert(nn.Linear(2, 2), "bf16", mode="eval")
