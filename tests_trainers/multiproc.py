"""Workers for the multi-process trainer tests: one run of two CPU processes (gloo), launched by
``python -m torch.distributed.run --standalone --nproc-per-node 2 multiproc.py MODE OUT``. Each rank writes
``OUT/rank<r>.json`` (its losses per configuration, whether it converted and saved a decision log, its final
parameters' checksum); the test reads them. Every collective has a 60 s timeout, and the test kills the launch
after its own timeout: a rank that fails fails the test, it never hangs it.

MODE: ``accelerate`` (Accelerator float32 / own bf16 / AmpfxAccelerator bf16 and fp16, then a resume from
``save_state`` on both ranks), ``hf`` (Trainer float32 / own bf16 / AmpfxTrainer bf16, then a resume from a
checkpoint on both ranks, then AmpfxTrainer fp16) or ``lightning`` (``import lightning as L``, DDP: float32 / bf16-mixed / AmpfxPrecision
bf16 and fp16, then a resume from the last checkpoint on both ranks).
"""
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

TIMEOUT = datetime.timedelta(seconds=60)
RANK = int(os.environ.get("RANK", "0"))


def checksum(model):
    return float(sum(p.detach().double().sum() for p in model.parameters()))


# --- Accelerate ---------------------------------------------------------------------------------------------------

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))


def shard(n=16):
    """This rank's batches: a different slice of one synthetic set on each rank."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * n, 32, 16, generator=g)[RANK::2]
    return [(xb, (xb[:, :4].argmax(1) + (xb[:, 4] > 1).long()) % 4) for xb in x]


def prepared(acc):
    net = mlp()
    return acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.2))


def accelerate_steps(acc, net, opt, batches):
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(net(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def accelerate_run(out):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import InitProcessGroupKwargs

    from ampfx.integrations.accelerate import AmpfxAccelerator

    handlers = [InitProcessGroupKwargs(backend="gloo", timeout=TIMEOUT)]
    made = {"fp32": lambda: Accelerator(cpu=True, kwargs_handlers=handlers),
            "own_bf16": lambda: Accelerator(cpu=True, mixed_precision="bf16", kwargs_handlers=handlers),
            "ampfx_bf16": lambda: AmpfxAccelerator("bf16", cpu=True, kwargs_handlers=handlers,
                                                   report_dir=out / "report"),
            "ampfx_fp16": lambda: AmpfxAccelerator("fp16", cpu=True, kwargs_handlers=handlers)}
    result = {}
    for name, make in made.items():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = make()
        net, opt = prepared(acc)
        result[name] = accelerate_steps(acc, net, opt, shard())
        result[f"{name}_checksum"] = checksum(net)
        if name.startswith("ampfx"):  # the float16 run saves no report: report_dir is the bf16 run's
            result[f"{name}_converted"] = acc.report is not None
            result[f"{name}_world"] = acc.num_processes
            result[f"{name}_scale"] = acc.scaler.get_scale() if acc.scaler is not None else None
    # resume: 8 steps, save_state on both ranks, 8 more; then a fresh accelerator loads the state and runs the 8 again
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = AmpfxAccelerator("bf16", cpu=True, kwargs_handlers=handlers)
    net, opt = prepared(acc)
    batches = shard()
    accelerate_steps(acc, net, opt, batches[:8])
    acc.save_state(str(out / "state"))
    result["straight"] = accelerate_steps(acc, net, opt, batches[8:])
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = AmpfxAccelerator("bf16", cpu=True, kwargs_handlers=handlers)
    net, opt = prepared(acc)
    acc.load_state(str(out / "state"))
    result["resumed"] = accelerate_steps(acc, net, opt, batches[8:])
    return result


# --- HF Trainer ---------------------------------------------------------------------------------------------------

def hf_run(out):
    from hf_parts import Data, Losses, bert
    from transformers import Trainer, TrainingArguments

    from ampfx.integrations.hf import AmpfxTrainer

    def train(folder, cls=Trainer, steps=8, resume=None, save=False, ampfx=None, **flags):
        args = TrainingArguments(output_dir=str(folder), max_steps=steps, per_device_train_batch_size=8,
                                 logging_steps=1, learning_rate=2e-3, report_to=[], use_cpu=True, seed=0,
                                 save_strategy="steps" if save else "no", save_steps=4, disable_tqdm=True,
                                 ddp_backend="gloo", ddp_timeout=int(TIMEOUT.total_seconds()), **flags)
        losses = Losses()
        extra = {"ampfx": ampfx} if ampfx else {}
        trainer = cls(model=bert(), args=args, train_dataset=Data(128), callbacks=[losses], **extra)
        trainer.train(resume_from_checkpoint=resume)
        return trainer, losses.losses

    result = {}
    _, result["fp32"] = train(out / "fp32")
    _, result["own_bf16"] = train(out / "own", bf16=True)
    os.environ.pop("ACCELERATE_MIXED_PRECISION", None)  # TrainingArguments(bf16=True) exported it
    trainer, result["ampfx_bf16"] = train(out / "ampfx", cls=AmpfxTrainer, save=True)
    result["ampfx_bf16_converted"] = trainer.ampfx_report is not None
    result["ampfx_bf16_world"] = trainer.args.world_size
    # transformers 4.57 loads optimizer.pt with map_location=args.device, which is "cpu:0" on a multi-process CPU run
    # and cannot be loaded (any Trainer, with or without ampfx); SGD without momentum has no state to lose
    (out / "ampfx" / "checkpoint-4" / "optimizer.pt").unlink(missing_ok=True)
    resumed, _ = train(out / "ampfx", cls=AmpfxTrainer, resume=str(out / "ampfx" / "checkpoint-4"))
    result["resumed_step"] = resumed.state.global_step
    result["ampfx_bf16_checksum"] = checksum(trainer.model)
    fp16, result["ampfx_fp16"] = train(out / "fp16", cls=AmpfxTrainer, ampfx="fp16")
    result["ampfx_fp16_checksum"] = checksum(fp16.model)
    result["ampfx_fp16_scale"] = fp16.accelerator.scaler.get_scale()
    return result


# --- Lightning ----------------------------------------------------------------------------------------------------

def lightning_run(out):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from ampfx.integrations.lightning import AmpfxPrecision
    from conftest import classifier

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    data = TensorDataset(x, (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4)

    def fit(folder, epochs=2, resume=None, checkpoint=False, **kwargs):
        torch.manual_seed(0)
        model = classifier(L)()
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=2, num_nodes=1,
                            strategy=DDPStrategy(process_group_backend="gloo", timeout=TIMEOUT),
                            default_root_dir=folder, logger=False, enable_checkpointing=checkpoint,
                            enable_progress_bar=False, enable_model_summary=False, **kwargs)
        trainer.fit(model, DataLoader(data, batch_size=32), ckpt_path=resume)
        return model, trainer

    result = {}
    result["fp32"] = fit(out / "fp32")[0].losses
    result["own_bf16"] = fit(out / "own", precision="bf16-mixed")[0].losses
    plugin = AmpfxPrecision("bf16", log_dir=out / "report")
    model, trainer = fit(out / "ampfx", plugins=[plugin], checkpoint=True)
    result["ampfx_bf16"], result["ampfx_bf16_converted"] = model.losses, plugin.report is not None
    result["ampfx_bf16_world"] = trainer.world_size
    result["ampfx_bf16_checksum"] = checksum(model)
    fp16 = fit(out / "fp16", plugins=[AmpfxPrecision("fp16")])[0]
    result["ampfx_fp16"], result["ampfx_fp16_checksum"] = fp16.losses, checksum(fp16)
    last = sorted((out / "ampfx").rglob("*.ckpt"))[-1]
    model, trainer = fit(out / "ampfx", epochs=3, resume=str(last), plugins=[AmpfxPrecision("bf16")])
    result["resumed_epoch"] = trainer.current_epoch
    return result


def main():
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    from ampfx.ops import device_cost, gemm_cost  # tiny models: every GEMM low, as the tests' conftest has it
    gemm_cost.BREAK_EVEN.clear()
    device_cost.measure_on(())  # and nothing measured
    result = {"accelerate": accelerate_run, "hf": hf_run, "lightning": lightning_run}[mode](out)
    (out / f"rank{RANK}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():  # left to exit, gloo's threads may be torn down running (SIGABRT)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
