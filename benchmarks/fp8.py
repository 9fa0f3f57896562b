"""FP8 under ampfx against torchao's float8 training (not a test): which GEMMs each puts in FP8, each layer's error,
and training loss.

1. **Share**: a GPT of GPT-2-medium's width (d=1024, 16 heads, MLP 4096, vocabulary 8192; 2 blocks, 4 x 1024
   tokens) converted with ``fp8="tensorwise"`` (the H100 roofline): which linear layers run in FP8 and their share
   of the forward's GEMM FLOPs, against torchao's auto filter for the recipe with the first and last linear layers
   excluded (as its docs recommend), counted on the same layers and sizes.
2. **Per-layer error**: each linear layer of a small GPT on an activation of the model, in FP8: ampfx's
   ``linear_fp8`` (the float32 master weight, the bf16 input) and torchao's ``Float8Linear`` with ``emulate=True``
   (the CPU emulation of its kernels, under autocast as torchao is used), each against the float32 layer: the
   relative error of the output and of the input and weight gradients.
3. **Training**: the small GPT trained with AdamW in bf16 and in FP8 by ampfx (every size: ``fp8_roofline="none"``),
   the mean of the last 20 losses of each.

torchao is optional (``pip install torchao==0.18.0``); without it the torchao columns are left out.

    .venv/bin/python benchmarks/fp8.py [--steps 300]
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import ampfx  # noqa: E402
from ampfx.runtime.fp8 import RECIPES, linear  # noqa: E402
from support.fidelity_models import TinyGPT, _gpt_init  # noqa: E402

try:
    from torchao.float8 import Float8LinearConfig, _auto_filter_for_recipe  # noqa: E402
    from torchao.float8.float8_linear import Float8Linear  # noqa: E402
except ImportError:
    Float8Linear = None


def share(recipe: str) -> None:
    torch.manual_seed(0)
    model = _gpt_init(TinyGPT(vocab=8192, d=1024, heads=16, layers=2, t_max=1024))
    tokens = torch.randint(0, 8192, (4, 1024))
    amp = ampfx.convert(copy.deepcopy(model), "bf16", example_inputs=(tokens,), fp8=recipe)
    rows = {r.module: r.fp8 for r in amp.ampfx_report.records if r.fp8 is not None and r.op == "linear"}
    total = sum(r.fp8.flops for r in amp.ampfx_report.records if r.fp8 is not None)
    ours = sum(f.flops for f in rows.values() if f.output)
    print(f"## FP8 share, fp8={recipe!r}, GPT d=1024, 2 blocks, M=4096 tokens "
          f"(GEMM FLOPs of one forward: {total / 1e9:.1f} G)")
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    chosen = None
    if Float8Linear is not None:
        keep = _auto_filter_for_recipe(recipe, filter_fqns=[linears[0], linears[-1]])
        chosen = {n for n, m in model.named_modules() if keep(m, n)}
    print("| layer | N x K | ampfx | rule | torchao auto filter |")
    print("|---|---|---|---|---|")
    for name in linears:
        m, d = model.get_submodule(name), rows.get(name)
        theirs = "-" if chosen is None else ("fp8" if name in chosen else "bf16")
        print(f"| {name} | {m.out_features} x {m.in_features} | {'fp8' if d and d.output else 'bf16'} | "
              f"{d.rule if d else '-'} | {theirs} |")
    line = f"ampfx: {ours / total:.1%} of GEMM FLOPs in FP8"
    if chosen is not None:
        theirs = sum(rows[n].flops for n in chosen if n in rows)
        line += f"; torchao auto filter + first/last excluded: {theirs / total:.1%}"
    print(line + "\n")


def _activations(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each linear layer's input on ``tokens`` (the float32 model)."""
    seen, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            hooks.append(m.register_forward_pre_hook(lambda mod, a, n=name: seen.setdefault(n, a[0].detach())))
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    return seen


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _errors(layer: nn.Linear, x: torch.Tensor, g: torch.Tensor, run) -> tuple[float, float, float]:
    """Relative errors of ``run(layer, x)`` (output, input gradient, weight gradient) against the float32 layer."""
    ref_layer, ref_x = copy.deepcopy(layer), x.clone().requires_grad_()
    ref = F.linear(ref_x, ref_layer.weight, ref_layer.bias)
    ref.backward(g)
    mine_layer, mine_x = copy.deepcopy(layer), x.clone().requires_grad_()
    out = run(mine_layer, mine_x)
    out.float().backward(g)
    return _rel(out, ref), _rel(mine_x.grad, ref_x.grad), _rel(mine_layer.weight.grad, ref_layer.weight.grad)


def per_layer(recipe: str) -> None:
    torch.manual_seed(0)
    model = _gpt_init(TinyGPT(vocab=512, d=256, heads=4, layers=2, t_max=64))
    tokens = torch.randint(0, 512, (4, 64))
    xs = _activations(model, tokens)

    def ours(layer, x):
        bias = None if layer.bias is None else layer.bias.to(torch.bfloat16)
        return linear(x.to(torch.bfloat16), layer.weight, bias, RECIPES[recipe])

    def torchao(layer, x):
        f8 = Float8Linear.from_float(layer, config=Float8LinearConfig.from_recipe_name(recipe).__class__(
            **{**Float8LinearConfig.from_recipe_name(recipe).__dict__, "emulate": True}))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return f8(x)

    print(f"## Per-layer relative error against float32, fp8={recipe!r}, GPT d=256, M=256 tokens")
    print("| layer | N x K | ampfx out | torchao out | ampfx dx | torchao dx | ampfx dw | torchao dw |")
    print("|---|---|---|---|---|---|---|---|")
    worse = []
    for name, x in xs.items():
        layer = model.get_submodule(name)
        g = torch.randn(*x.shape[:-1], layer.out_features, generator=torch.Generator().manual_seed(1))
        a = _errors(layer, x, g, ours)
        t = _errors(layer, x, g, torchao) if Float8Linear is not None else (float("nan"),) * 3
        worse += [name for ea, et in zip(a, t) if ea > et * 1.05]
        print(f"| {name} | {layer.out_features} x {layer.in_features} | {a[0]:.4f} | {t[0]:.4f} | {a[1]:.4f} | "
              f"{t[1]:.4f} | {a[2]:.4f} | {t[2]:.4f} |")
    print(f"layers where an ampfx error exceeds torchao's by more than 5%: {sorted(set(worse)) or 'none'}\n")


def training(recipe: str, steps: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.fidelity_models import gpt

    def tokens(step):
        g = torch.Generator().manual_seed(step)
        start, band = torch.randint(0, 8, (8, 1), generator=g), torch.randint(0, 8, (8, 1), generator=g)
        return band * 8 + (start + torch.arange(17)) % 8

    def run(**options):
        model = gpt()[0]
        amp = ampfx.convert(model, "bf16", example_inputs=(tokens(0)[:, :-1],), **options)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for step in range(steps):
            t = tokens(step)
            loss = F.cross_entropy(amp(t[:, :-1]).float().reshape(-1, 64), t[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return sum(losses[-20:]) / 20

    bf16, fp8 = run(), run(fp8=recipe, fp8_roofline="none")
    print(f"## Training, small GPT (d=32), {steps} AdamW steps: last-20 mean loss bf16 {bf16:.4f}, "
          f"fp8={recipe!r} {fp8:.4f} ({fp8 / bf16 - 1:+.2%})\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--recipes", default="tensorwise,rowwise")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}; torchao {'not installed' if Float8Linear is None else 'installed'}\n")
    for recipe in args.recipes.split(","):
        share(recipe)
        per_layer(recipe)
        training(recipe, args.steps)


if __name__ == "__main__":
    main()
