"""AmpfxPrecision with the unified ``lightning`` package (``import lightning as L``, as Lightning's docs teach since
2.0): its Trainer takes the plugin and trains like its own bf16 mode; the standalone package's Trainer still does."""
import logging

import pytest
import torch
from conftest import classifier, gap
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning")
pl = pytest.importorskip("pytorch_lightning")
from ampfx.integrations.lightning import AmpfxPrecision  # noqa: E402

logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    y = (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4
    return DataLoader(TensorDataset(x, y), batch_size=32)


def fit(package, tmp_path, **trainer_kwargs):
    torch.manual_seed(0)
    model = classifier(package)()
    trainer = package.Trainer(max_epochs=3, accelerator="cpu", default_root_dir=tmp_path, logger=False,
                              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                              **trainer_kwargs)
    trainer.fit(model, data())
    return model, trainer


def test_lightning_unified_trainer_takes_the_plugin_and_trains_like_its_own_bf16(tmp_path):
    """Rule: L.Trainer(plugins=[AmpfxPrecision('bf16')]) trains (it raised MisconfigurationException: invalid
    plugin type); the loss curve is as close to L's precision='bf16-mixed' as that is to float32."""
    fp32, _ = fit(L, tmp_path / "fp32")
    own, _ = fit(L, tmp_path / "own", precision="bf16-mixed")
    amp, trainer = fit(L, tmp_path / "ampfx", plugins=[AmpfxPrecision("bf16")])
    assert isinstance(trainer.precision_plugin, AmpfxPrecision) and trainer.precision_plugin.report is not None
    assert gap(amp.losses, own.losses) <= 2 * gap(own.losses, fp32.losses) + 1e-3
    assert amp.losses[-1] < 0.8 * amp.losses[0]


def test_the_standalone_packages_trainer_still_takes_it(tmp_path):
    """Rule: the same class is a Precision of both packages."""
    amp, trainer = fit(pl, tmp_path, plugins=[AmpfxPrecision("bf16")])
    assert trainer.precision_plugin.report is not None and amp.losses[-1] < 0.8 * amp.losses[0]
    assert isinstance(AmpfxPrecision("bf16"), (L.pytorch.plugins.precision.Precision,
                                                pl.plugins.precision.Precision))
    assert repr(AmpfxPrecision("fp16")) == "AmpfxPrecision('float16', precision='16-mixed')"
