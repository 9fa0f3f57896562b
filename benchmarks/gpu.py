"""The GPU suite (not a test): step time and peak memory of fp32 / autocast / ampfx, eager and compiled.

One command when a GPU is there: ``python benchmarks/gpu.py`` runs, for bf16 and fp16,

1. a training step (forward, loss, backward, SGD step; fp16 with ``torch.amp.GradScaler``) of a
   GPT-2-small-like LM, a BERT-base-like MLM encoder, a ResNet-50 and a ViT-B/16, all built from
   their configurations in this file with random weights (nothing is downloaded), in float32,
   under ``torch.autocast`` and converted by ampfx, eager and with ``torch.compile``: median step
   time of ``--reps`` runs after warm-up, peak memory, and both as ratios to float32 eager;
2. gradient accumulation: an optimizer step of ``--accum`` micro-batches (default 4) of the GPT-2-like
   LM (or the first model asked for), under ``torch.autocast`` and converted by ampfx with its weight cache
   (``weight_cache=True``: each weight cast once per step, gradients added into ``.grad`` without a cast) and
   without it (the default: cast at every micro-batch, as autocast does), eager and compiled;
3. FP8: a GPT-2-medium-sized LM (d=1024, 24 layers, 8 x 1024 tokens) in ampfx bf16, ampfx ``fp8="tensorwise"``
   and torchao's float8 training (tensorwise, when torchao is installed), eager and compiled, as ratios to
   ampfx bf16 (``--no-fp8`` skips it);
4. GEMM padding on odd shapes (vocabulary 50257, hidden 1000 and 3000, sequence 77) and on the
   tensor-core friendly shapes of NVIDIA's guide (multiples of 8/64): ampfx ``pad="never"``,
   ``pad="always"`` and autocast, forward + backward.

Versions, device and date are printed first. ``--smoke`` runs tiny configurations on the CPU
without compile, to check the script end to end (tests/test_gpu_suite.py does, in CI); CPU
figures say nothing about GPU speed. Record GPU figures in docs/benchmarks.md.

``--cpu`` times a small transformer and a small CNN on the CPU, eager and compiled (inductor), bf16.

    python benchmarks/gpu.py [--smoke | --cpu] [--models gpt2,bert,resnet50,vit] [--dtypes bf16,fp16]
                             [--no-compile] [--reps 20] [--accum 4]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ampfx  # noqa: E402
from gemm_padding import timed  # noqa: E402

FULL = {
    "gpt2": dict(vocab=50257, d=768, layers=12, heads=12, seq=512, batch=8),
    "bert": dict(vocab=30522, d=768, layers=12, heads=12, seq=128, batch=32),
    "resnet50": dict(blocks=(3, 4, 6, 3), width=64, image=224, batch=64, classes=1000),
    "vit": dict(d=768, layers=12, heads=12, patch=16, image=224, batch=64, classes=1000),
}
SMOKE = {
    "gpt2": dict(vocab=101, d=32, layers=1, heads=2, seq=16, batch=2),
    "bert": dict(vocab=101, d=32, layers=1, heads=2, seq=16, batch=2),
    "resnet50": dict(blocks=(1, 1, 1, 1), width=8, image=32, batch=2, classes=10),
    "vit": dict(d=32, layers=1, heads=2, patch=8, image=32, batch=2, classes=10),
}
CPU = {  # --cpu: the compiled step on this machine's CPU (small GEMMs, where bf16 runs near fp32 speed)
    "gpt2": dict(vocab=512, d=128, layers=2, heads=4, seq=64, batch=8),
    "resnet50": dict(blocks=(1, 1, 1, 1), width=16, image=64, batch=8, classes=10),
}
GEMMS_FULL = [(8 * 77, 768, 50257), (4096, 1000, 1000), (4096, 3000, 3000), (4096, 1024, 1024), (4096, 3072, 3072)]
GEMMS_SMOKE = [(2 * 7, 24, 101), (16, 20, 20), (16, 24, 24)]


# ---------------------------------------------------------------------- models from configurations
class LM(nn.Module):
    """GPT-2-like (pre-LN, causal) when ``causal``, else BERT-like (post-LN) with an MLM head."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int, causal: bool) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, activation="gelu", batch_first=True,
                                           norm_first=causal)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.causal = causal
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos.weight[: ids.shape[1]]
        x = self.blocks(x, mask=self.mask[: ids.shape[1], : ids.shape[1]] if self.causal else None)
        return self.head(self.norm(x))


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


class ResNet(nn.Module):
    """ResNet-50's layout (bottlenecks 3-4-6-3, widths 64-128-256-512) from ``blocks`` and ``width``."""

    def __init__(self, blocks: tuple[int, ...], width: int, classes: int, **_: Any) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                                   nn.MaxPool2d(3, 2, 1)]
        cin = width
        for stage, n in enumerate(blocks):
            for i in range(n):
                layers.append(Bottleneck(cin, width * 2 ** stage, 2 if i == 0 and stage > 0 else 1))
                cin = 4 * width * 2 ** stage
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean((2, 3)))


class ViT(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, patch: int, image: int, classes: int, **_: Any) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


def build(name: str, cfg: dict[str, Any], device: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model, its input batch and its targets."""
    if name in ("gpt2", "bert"):
        model = LM(cfg["vocab"], cfg["d"], cfg["layers"], cfg["heads"], cfg["seq"], causal=name == "gpt2")
        ids = torch.randint(cfg["vocab"], (cfg["batch"], cfg["seq"]))
        return model.to(device), ids.to(device), torch.randint(cfg["vocab"], ids.shape).to(device)
    model = ResNet(**cfg) if name == "resnet50" else ViT(**cfg)
    x = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"])
    return model.to(device), x.to(device), torch.randint(cfg["classes"], (cfg["batch"],)).to(device)


# ---------------------------------------------------------------------- one training step, three ways
def step_fn(model: nn.Module, run: nn.Module, x: torch.Tensor, y: torch.Tensor, device: str, dtype: torch.dtype,
            autocast: bool) -> Callable[[], None]:
    """forward, cross-entropy, backward and an SGD step; fp16 goes through a GradScaler."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device) if dtype is torch.float16 and device == "cuda" else None

    def step() -> None:
        ctx = torch.autocast(device, dtype) if autocast else contextlib.nullcontext()
        with ctx:
            out = run(x)
        loss = F.cross_entropy(out.float().flatten(0, -2), y.flatten())
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def measure(step: Callable[[], None], reps: int, device: str) -> tuple[float, float | None]:
    """Median seconds per step, and peak memory in MB (CUDA only)."""
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    seconds = timed(step, reps, device)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    return seconds, peak


def model_rows(name: str, cfg: dict[str, Any], dtypes: list[torch.dtype], compile_: bool, reps: int,
               device: str) -> None:
    torch.manual_seed(0)
    model, x, y = build(name, cfg, device)
    base = None
    for dtype in dtypes:
        runs: dict[str, tuple[nn.Module, bool]] = {"fp32": (model, False), "autocast": (model, True),
                                                   "ampfx": (ampfx.convert(model, dtype, example_inputs=(x,)), False)}
        for mode in ("eager", "compile") if compile_ else ("eager",):
            for how, (run, autocast) in runs.items():
                if how == "fp32" and dtype is not dtypes[0]:
                    continue
                module = torch.compile(run) if mode == "compile" else run
                seconds, peak = measure(step_fn(model, module, x, y, device, dtype, autocast), reps, device)
                if base is None:
                    base = (seconds, peak)
                ratio = seconds / base[0]
                mem = f"{peak:>10.0f}{peak / base[1]:>9.2f}" if peak is not None and base[1] else f"{'-':>10}{'-':>9}"
                label = "fp32" if how == "fp32" else f"{how} {str(dtype)[6:]}"
                print(f"{name:<10}{label:<18}{mode:<9}{seconds * 1e3:>10.2f}{ratio:>9.2f}{mem}", flush=True)


def accum_fn(model: nn.Module, run: nn.Module, x: torch.Tensor, y: torch.Tensor, device: str, dtype: torch.dtype,
             autocast: bool, k: int) -> Callable[[], None]:
    """``k`` micro-batches (forward, float32 cross-entropy inside autocast's region, backward), one SGD step;
    fp16 through a GradScaler."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device) if dtype is torch.float16 and device == "cuda" else None

    def step() -> None:
        for _ in range(k):
            with torch.autocast(device, dtype) if autocast else contextlib.nullcontext():
                out = run(x)
                loss = F.cross_entropy(out.float().flatten(0, -2), y.flatten()) / k
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def accum_rows(name: str, cfg: dict[str, Any], dtypes: list[torch.dtype], compile_: bool, reps: int, device: str,
               k: int) -> None:
    """Step time and peak memory of one optimizer step of ``k`` micro-batches, as ratios to autocast's."""
    torch.manual_seed(0)
    model, x, y = build(name, cfg, device)
    for dtype in dtypes:
        runs: dict[str, tuple[nn.Module, bool]] = {
            "autocast": (model, True),
            "ampfx cache": (ampfx.convert(model, dtype, example_inputs=(x,), weight_cache=True), False),
            "ampfx": (ampfx.convert(model, dtype, example_inputs=(x,)), False)}
        for mode in ("eager", "compile") if compile_ else ("eager",):
            base = None
            for how, (run, autocast) in runs.items():
                module = torch.compile(run) if mode == "compile" else run
                seconds, peak = measure(accum_fn(model, module, x, y, device, dtype, autocast, k), reps, device)
                base = base or (seconds, peak)
                mem = f"{peak:>10.0f}{peak / base[1]:>9.2f}" if peak is not None and base[1] else f"{'-':>10}{'-':>9}"
                print(f"{'accum ' + name:<16}{k:>3}  {how + ' ' + str(dtype)[6:]:<24}{mode:<9}{seconds * 1e3:>10.2f}"
                      f"{seconds / base[0]:>9.2f}{mem}", flush=True)


FP8_FULL = dict(vocab=50257, d=1024, layers=24, heads=16, seq=1024, batch=8)  # GPT-2 medium's sizes
FP8_SMOKE = dict(vocab=101, d=32, layers=1, heads=2, seq=16, batch=2)


def fp8_rows(cfg: dict[str, Any], compile_: bool, reps: int, device: str, every_size: bool) -> None:
    """A GPT-2-medium-sized LM's training step: ampfx bf16, ampfx ``fp8="tensorwise"`` (the H100 roofline; with
    ``every_size``, the smoke run, every linear but the first and last) and torchao's float8 training (tensorwise,
    its auto filter, first and last linear excluded; when torchao is installed), as ratios to ampfx bf16."""
    torch.manual_seed(0)
    model, x, y = build("gpt2", cfg, device)
    options = {"fp8_roofline": "none"} if every_size else {}
    amp8 = ampfx.convert(model, torch.bfloat16, example_inputs=(x,), fp8="tensorwise", **options)
    runs: dict[str, tuple[nn.Module, nn.Module, bool]] = {
        "ampfx bf16": (model, ampfx.convert(model, torch.bfloat16, example_inputs=(x,)), False),
        "ampfx fp8": (model, amp8, False)}
    print(next((line for line in amp8.ampfx_report.summary().splitlines() if "FP8" in line), "  FP8: none"))
    try:
        import copy

        from torchao.float8 import _auto_filter_for_recipe, convert_to_float8_training
        theirs = copy.deepcopy(model)
        linears = [n for n, m in theirs.named_modules() if isinstance(m, nn.Linear)]
        keep = _auto_filter_for_recipe("tensorwise", filter_fqns=[linears[0], linears[-1]])
        convert_to_float8_training(theirs, module_filter_fn=keep)
        runs["torchao fp8"] = (theirs, theirs, True)
    except Exception as e:  # noqa: BLE001 - optional: torchao absent, or without float8 training here
        print(f"  torchao: not run ({type(e).__name__}: {str(e)[:80]})")
    for mode in ("eager", "compile") if compile_ else ("eager",):
        base = None
        for how, (owner, run, autocast) in runs.items():
            module = torch.compile(run) if mode == "compile" else run
            seconds, peak = measure(step_fn(owner, module, x, y, device, torch.bfloat16, autocast), reps, device)
            base = base or (seconds, peak)
            mem = f"{peak:>10.0f}{peak / base[1]:>9.2f}" if peak is not None and base[1] else f"{'-':>10}{'-':>9}"
            print(f"{'fp8 gpt2':<10}{how:<18}{mode:<9}{seconds * 1e3:>10.2f}{seconds / base[0]:>9.2f}{mem}",
                  flush=True)


def gemm_rows(shapes: list[tuple[int, int, int]], dtypes: list[torch.dtype], reps: int, device: str) -> None:
    for m, k, n in shapes:
        for dtype in dtypes:
            lin, x = nn.Linear(k, n).to(device), torch.randn(m, k, device=device)
            runs = {mode: (lambda gm=ampfx.convert(lin, dtype, example_inputs=(x,), pad=mode):
                           gm(x).float().pow(2).mean().backward()) for mode in ("never", "always")}

            def autocast_step() -> None:
                with torch.autocast(device, dtype):
                    out = lin(x)
                out.float().pow(2).mean().backward()

            runs["autocast"] = autocast_step
            t = {mode: timed(fn, reps, device) for mode, fn in runs.items()}
            friendly = "yes" if k % 64 == 0 and n % 64 == 0 else "no"
            print(f"{f'{m}x{k} -> {n}':<22}{str(dtype)[6:]:<10}{friendly:<10}{t['never'] * 1e3:>10.3f}"
                  f"{t['always'] * 1e3:>11.3f}{t['autocast'] * 1e3:>13.3f}{t['always'] / t['never']:>9.2f}"
                  f"{t['autocast'] / t['never']:>9.2f}", flush=True)


def header(device: str, smoke: bool) -> None:
    name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
    print(f"ampfx GPU suite{' (smoke: tiny configurations, CPU)' if smoke else ''}: {datetime.date.today()}, "
          f"device {device} ({name}), torch {torch.__version__}, CUDA {torch.version.cuda}, python "
          f"{platform.python_version()}, ampfx {ampfx.__version__}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny configurations on the CPU, no compile")
    ap.add_argument("--cpu", action="store_true", help="small transformer and CNN on the CPU, eager and compiled "
                                                       "(inductor), bf16: the CPU compiled-step ratios")
    ap.add_argument("--models", default="gpt2,bert,resnet50,vit")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step in the gradient "
                                                        "accumulation table (0: skip it)")
    ap.add_argument("--no-fp8", dest="fp8", action="store_false", help="skip the FP8 table (a GPT-2-medium-sized "
                                                                       "LM: ampfx bf16, ampfx fp8, torchao fp8)")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke or args.cpu or not torch.cuda.is_available() else "cuda"
    configs = CPU if args.cpu else SMOKE if args.smoke or device == "cpu" else FULL
    reps = args.reps or (2 if args.smoke else 10 if args.cpu else 20)
    if args.cpu:
        args.models = ",".join(m for m in args.models.split(",") if m in CPU)
        args.dtypes = "bf16" if args.dtypes == ap.get_default("dtypes") else args.dtypes
    dtypes = [ampfx.policy.names.parse_dtype(d, where="--dtypes") for d in args.dtypes.split(",")]
    compile_ = not (args.smoke or args.no_compile)
    header(device, args.smoke)
    print(f"\n{'model':<10}{'run':<18}{'mode':<9}{'step ms':>10}{'x fp32':>9}{'peak MB':>10}{'x fp32':>9}")
    for name in args.models.split(","):
        if name not in configs:
            ap.error(f"--models: unknown model {name!r}; choose from {', '.join(configs)}")
        model_rows(name, configs[name], dtypes, compile_, reps, device)
    if args.accum:
        name = "gpt2" if "gpt2" in args.models.split(",") else args.models.split(",")[0]
        print(f"\n{'accumulation':<16}{'k':>3}  {'run':<24}{'mode':<9}{'step ms':>10}{'x ac':>9}{'peak MB':>10}"
              f"{'x ac':>9}")
        accum_rows(name, configs[name], dtypes, compile_, reps, device, args.accum)
    if args.fp8 and not args.cpu:
        print(f"\n{'fp8':<10}{'run':<18}{'mode':<9}{'step ms':>10}{'x bf16':>9}{'peak MB':>10}{'x bf16':>9}")
        fp8_rows(FP8_SMOKE if configs is SMOKE else FP8_FULL, compile_, reps, device, every_size=configs is SMOKE)
    if not args.cpu:
        print(f"\n{'GEMM M x K -> N':<22}{'dtype':<10}{'friendly':<10}{'never ms':>10}{'always ms':>11}"
              f"{'autocast ms':>13}{'alw/nev':>9}{'ac/nev':>9}")
        gemm_rows(GEMMS_SMOKE if configs is SMOKE else GEMMS_FULL, dtypes, reps, device)


if __name__ == "__main__":
    main()
