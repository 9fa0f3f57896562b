"""Step time against torch.autocast (not a test): the yardstick of every runtime change.

A training step (forward, the loss computed in float32 inside autocast's region as users write it, backward, an
SGD step) of float32, ``torch.autocast`` and ``ampfx.convert`` on real models of many families, built small from
configurations with random weights (no downloads): CNNs with batch norm, ViTs, encoder and decoder LMs (one trained
with Hugging Face gradient checkpointing, one mixture of experts), seq2seq text and speech models, a diffusion UNet,
RNNs, a recommender and a graph network. The three runs are interleaved step by step in one process per model,
after two warm-up steps, in an order shuffled anew at each repeat (:func:`interleaved`), and the median of the
repeats is kept; on the CPU with one thread. Per model it prints
each tool's median step, ampfx / autocast, and the time per step spent outside ATen ops (torch.profiler: a step's
wall time less its top-level ATen ops) for both tools; ``--compile`` adds the same with ``torch.compile``
(inductor) around each (slow on the CPU: minutes per model). Rows of one run compare; runs on other machines or
at other times do not.

Needs the models lane's environment (torchvision, timm, transformers; diffusers if installed):

    bash scripts/test-models.sh --co -q       # makes .venv-models once
    .venv-models/bin/python benchmarks/step_time.py [--models a,b] [--dtype bf16] [--reps 11] [--compile]

Each row also counts the casts of one step (``ampfx.count_casts``: dtype-changing copies, forward and backward) of
autocast and of ampfx's default, and says how many GEMM nodes ampfx kept float32 as under the device's break-even (rule
``cost:small-gemm``: on a CPU, most GEMMs of these small models); ``--all-low`` adds a fourth run interleaved with
the others, ampfx with every GEMM low (``gemm_min_flops=0``), to tell what that rule brings from what the runtime
costs.

The summary line says what the step-time goal asks: the median ratio, the models above 1.05x, and those captured
whole (one graph) above 1.0x.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = {
    # CNNs with batch norm
    "tv_resnet18": "CNN, batch norm", "tv_mobilenet_v3_small": "CNN, batch norm, depthwise",
    "tv_efficientnet_b0": "CNN, batch norm, SE", "tv_squeezenet1_0": "CNN, fire modules",
    "tv_convnext_tiny": "CNN, layer norm, layer scale", "tv_regnet_y_400mf": "CNN, batch norm, SE",
    # vision transformers
    "tv_vit_b_16": "ViT", "timm_vit_tiny": "ViT", "timm_swin_tiny": "windowed ViT", "hf_vit": "ViT (HF)",
    # encoder LMs
    "hf_bert_seqcls": "encoder LM", "hf_distilbert": "encoder LM",
    # decoder LMs
    "hf_gpt2_lm_nocache": "decoder LM", "hf_gpt2_ckpt": "decoder LM, gradient checkpointing",
    "hf_llama_nocache": "decoder LM (RoPE, RMSNorm)", "hf_mixtral": "decoder LM, mixture of experts",
    # seq2seq
    "hf_t5_nocache": "seq2seq text", "hf_bart_nocache": "seq2seq text", "hf_whisper": "seq2seq speech",
    # others
    "unet": "diffusion UNet", "nn_lstm_cls": "RNN (LSTM)", "nn_gru_cls": "RNN (GRU)",
    "nn_transformer": "nn.Transformer", "dlrm": "recommender", "gcn": "graph network (scatter)",
}


def build(name):
    """``(model, inputs, loss spec)`` for ``name``: the coverage benchmark's models and a few of this one's."""
    import torch

    import coverage
    g = torch.Generator().manual_seed(0)
    B, S, V, NC = coverage.B, coverage.S, coverage.V, coverage.NC
    if name == "tv_squeezenet1_0":
        import torchvision.models as tvm
        return tvm.squeezenet1_0(num_classes=NC), (torch.randn(B, 3, 64, 64, generator=g),), \
            ("ce", torch.randint(0, NC, (B,), generator=g))
    if name == "hf_gpt2_ckpt":
        model, inp, spec = coverage.build("hf_gpt2_lm_nocache")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model, inp, spec
    if name == "hf_mixtral":
        import transformers as tf
        cfg = tf.MixtralConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=64)
        ids = torch.randint(0, V, (B, S), generator=g)
        return tf.MixtralForCausalLM(cfg), {"input_ids": ids, "labels": ids, "use_cache": False}, ("hf", None)
    if name == "hf_whisper":
        import transformers as tf
        cfg = tf.WhisperConfig(vocab_size=V, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2,
                               encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=128,
                               decoder_ffn_dim=128, max_source_positions=32, max_target_positions=32,
                               decoder_start_token_id=1, pad_token_id=0)
        feats = torch.randn(B, 16, 64, generator=g)
        labels = torch.randint(2, V, (B, S), generator=g)
        return tf.WhisperForConditionalGeneration(cfg), {"input_features": feats, "labels": labels,
                                                          "use_cache": False}, ("hf", None)
    if name == "unet":
        try:
            return coverage.build("diffusers_unet2d")
        except ImportError:
            return _unet(g), (torch.randn(B, 3, 16, 16, generator=g), torch.tensor([10, 500])), \
                ("mse", torch.randn(B, 3, 16, 16, generator=g))
    return coverage.build(name)


def _unet(g):
    """A small diffusion UNet in plain torch (when diffusers is not installed): timestep embedding, group norm, SiLU,
    a self-attention block at the bottom, nearest upsampling and skip connections."""
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Res(nn.Module):
        def __init__(self, cin, cout, temb):
            super().__init__()
            self.n1, self.c1 = nn.GroupNorm(8, cin), nn.Conv2d(cin, cout, 3, padding=1)
            self.t = nn.Linear(temb, cout)
            self.n2, self.c2 = nn.GroupNorm(8, cout), nn.Conv2d(cout, cout, 3, padding=1)
            self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

        def forward(self, x, t):
            h = self.c1(F.silu(self.n1(x))) + self.t(t)[:, :, None, None]
            return self.skip(x) + self.c2(F.silu(self.n2(h)))

    class Attn(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.n, self.qkv, self.o = nn.GroupNorm(8, c), nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)

        def forward(self, x):
            b, c, hh, ww = x.shape
            q, k, v = self.qkv(self.n(x)).reshape(b, 3, c, hh * ww).unbind(1)
            a = torch.softmax(q.transpose(1, 2) @ k / math.sqrt(c), dim=-1)
            return x + self.o((v @ a.transpose(1, 2)).reshape(b, c, hh, ww))

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.temb = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 64))
            self.inp = nn.Conv2d(3, 32, 3, padding=1)
            self.d1, self.d2 = Res(32, 32, 64), Res(32, 64, 64)
            self.mid, self.attn = Res(64, 64, 64), Attn(64)
            self.u2, self.u1 = Res(128, 32, 64), Res(64, 32, 64)
            self.out = nn.Sequential(nn.GroupNorm(8, 32), nn.SiLU(), nn.Conv2d(32, 3, 3, padding=1))

        def forward(self, x, t):
            half = torch.arange(16, device=x.device) / 16
            f = t.float()[:, None] * torch.exp(-math.log(10000) * half)[None]
            e = self.temb(torch.cat([f.sin(), f.cos()], dim=-1))
            h0 = self.inp(x)
            h1 = self.d1(h0, e)
            h2 = self.d2(F.avg_pool2d(h1, 2), e)
            m = self.attn(self.mid(h2, e))
            u = self.u2(torch.cat([m, h2], 1), e)
            u = self.u1(torch.cat([F.interpolate(u, scale_factor=2.0, mode="nearest"), h1], 1), e)
            return self.out(u)

    return UNet()


def loss_of(out, spec):
    import coverage
    return coverage.loss_of(out, spec)


def call(m, inp):
    return m(**inp) if isinstance(inp, dict) else m(*inp)


def training_step(run, model, inp, spec, autocast=None, loss=None):
    """One training step of ``run`` (``model`` or a module over its parameters): forward, the loss (``loss``, default
    :func:`loss_of`) in float32 inside ``torch.autocast(autocast)``'s region when given, backward, an SGD step."""
    import torch
    loss = loss or loss_of
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        model.zero_grad(set_to_none=True)
        if autocast is not None:
            with torch.autocast("cpu", dtype=autocast):
                value = loss(call(run, inp), spec)
        else:
            value = loss(call(run, inp), spec)
        value.backward()
        opt.step()
    return step


def interleaved(tools: list, k: int) -> list:
    """The order the tools run in at repeat ``k``: shuffled, a seed per repeat. A step runs slower right after
    another tool's step that filled the caches with other tensors (on an AVX2-only CPU whichever tool ran right
    after autocast's bfloat16 step read 7-8% slower than when run after another), so a fixed order favours
    one tool; a shuffle gives each tool each neighbour about as often, the same in every run.

    >>> interleaved(["float32", "autocast", "ampfx"], 0) == interleaved(["float32", "autocast", "ampfx"], 0)
    True
    """
    import random
    return random.Random(k).sample(tools, len(tools))


def _aten_seconds(prof) -> float:
    """Seconds of a profiled step spent in top-level ATen ops (an ATen op inside another counts once)."""
    total = 0.0
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("aten::"):
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            total += e.time_range.elapsed_us() / 1e6
    return total


def scaled(value, batch, times):
    """``value`` (inputs, or a loss spec) with each tensor whose first size is the batch repeated ``times`` along it
    (the training size of a model converted on its small example)."""
    import torch
    if times == 1:
        return value
    if isinstance(value, torch.Tensor):
        return value.repeat(times, *([1] * (value.dim() - 1))) if value.dim() and value.shape[0] == batch else value
    if isinstance(value, dict):
        return {k: scaled(v, batch, times) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(scaled(v, batch, times) for v in value)
    return value


def run_case(name: str, dt: str, reps: int, compiled: bool, all_low: bool = False, scale: int = 1) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import ampfx
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    base, example, spec = build(name)
    base.train()
    import coverage
    inp, spec = scaled(example, coverage.B, scale), scaled(spec, coverage.B, scale)  # trained at scale x the batch
    r = {"model": name, "family": MODELS.get(name, ""), "dtype": dt, "compiled": compiled}
    runs = {}
    tools = ("float32", "autocast", "ampfx") + (("all_low",) if all_low else ()) + (("backend",) if compiled else ())
    for tool in tools:
        model = copy.deepcopy(base)
        run = model
        if tool == "ampfx":
            t0 = time.perf_counter()
            run = ampfx.convert(model, dtype, example_inputs=example)
            r["convert_s"] = round(time.perf_counter() - t0, 2)
            r["capture"] = [(p.path, p.method) for p in run.ampfx_report.parts]
            r["small_gemms"] = sum(1 for d in run.ampfx_report.records if d.rule.value.startswith("cost:"))
            r["gemm_nodes"] = sum(1 for d in run.ampfx_report.records
                                  if d.op in ampfx.ops.ENTRIES and ampfx.ops.ENTRIES[d.op].category is ampfx.Category.ALLOW)
        elif tool == "all_low":  # every GEMM low, whatever its size (the plan before the break-even rule)
            run = ampfx.convert(model, dtype, example_inputs=example, gemm_min_flops=0)
        if compiled:  # the backend: torch.compile(model, backend="ampfx"), each graph dynamo captures converted
            run = torch.compile(run, backend=ampfx.backend(dtype) if tool == "backend" else "inductor")
        runs[tool] = training_step(run, model, inp, spec, dtype if tool == "autocast" else None)
    for tool in list(runs):  # a tool that cannot train this model (autocast's bfloat16 LSTM needs oneDNN's
        try:               # avx512_bf16 kernels) is reported, and the others compared without it
            runs[tool]()
        except Exception as e:  # noqa: BLE001 - the row says so
            if tool in ("float32", "ampfx"):
                raise
            r[f"{tool}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            del runs[tool]
    times = {tool: [] for tool in runs}
    for k in range(reps + 2):
        for tool in interleaved(list(runs), k):
            step = runs[tool]
            t0 = time.perf_counter()
            step()
            if k >= 2:
                times[tool].append(time.perf_counter() - t0)
    for tool, ts in times.items():
        r[f"{tool}_ms"] = statistics.median(ts) * 1e3
    for tool in ("autocast", "ampfx"):
        if tool not in runs:
            continue
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            runs[tool]()
            wall = time.perf_counter() - t0
        r[f"{tool}_outside_ms"] = (wall - _aten_seconds(prof)) * 1e3
    for tool in ("autocast", "ampfx"):  # dtype-changing copies of one step (forward, backward, the SGD step)
        if tool in runs:
            r[f"{tool}_casts"] = ampfx.count_casts(runs[tool])
    auto = r.get("autocast_ms")  # None where autocast failed: ratios against it are not made
    r["ratio"] = r["ampfx_ms"] / auto if auto else None
    r["best_ratio"] = r["ampfx_ms"] / min(r["float32_ms"], auto or math.inf)
    if all_low:
        r["all_low_ratio"] = r["all_low_ms"] / auto if auto and "all_low_ms" in r else None
    if compiled:
        r["backend_ratio"] = r["backend_ms"] / auto if auto and "backend_ms" in r else None
    return r


def _recheck(args, rows) -> None:
    """``--recheck``: each row above the ratio timed again alone with 3x the steps; its figures replace the row's
    (both printed)."""
    for res in [r for r in rows if r.get("best_ratio", 0) > args.recheck]:
        p = subprocess.run([sys.executable, __file__, "--one", res["model"], str(int(res["compiled"])), "--dtype",
                            args.dtype, "--reps", str(3 * args.reps), "--scale", str(args.scale)],
                           capture_output=True, text=True, timeout=3600)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if not line:
            print(f"recheck {res['model']}: ERROR {p.stderr[-300:]}", flush=True)
            continue
        again = json.loads(line[-1][7:])
        if "best_ratio" not in again:
            print(f"recheck {res['model']}: ERROR {str(again.get('error', ''))[-300:]}", flush=True)
            continue
        print(f"recheck {res['model']:24s} {3 * args.reps} steps alone: float32 {again['float32_ms']:8.2f} ms  "
              f"autocast {_ms(again, 'autocast')}  ampfx {again['ampfx_ms']:8.2f}  ampfx/best "
              f"{again['best_ratio']:5.2f}x (was {res['best_ratio']:.2f}x)", flush=True)
        res.update({k: again.get(k) for k in ("float32_ms", "autocast_ms", "ampfx_ms", "ratio", "best_ratio")})


def _ms(res: dict, tool: str, width: int = 8) -> str:
    value = res.get(f"{tool}_ms")
    return f"{value:{width}.2f}" if value is not None else f"{'failed':>{width}s}"


def _x(ratio) -> str:
    return f"{ratio:5.2f}x" if ratio is not None else "    -"


def _median(ratios) -> str:
    seen = [x for x in ratios if x is not None]
    return f"{statistics.median(seen):.2f}x" if seen else "-"


def whole(capture) -> bool:
    """Captured as one graph: a single part, the root, by torch.fx or torch.export."""
    return len(capture or []) == 1 and capture[0][0] == "" and not capture[0][1].startswith("eager")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--compile", action="store_true", help="also time each tool under torch.compile, and ampfx "
                        "as the compile backend (torch.compile(model, backend=ampfx.backend(dtype)))")
    parser.add_argument("--compiled-only", action="store_true", help="--compile without the eager rows")
    parser.add_argument("--all-low", action="store_true", help="also time ampfx with every GEMM low "
                        "(gemm_min_flops=0), interleaved with the others")
    parser.add_argument("--scale", type=int, default=1, help="convert each model on its example, train it at this "
                        "many times its batch (the plan is made again where the size crosses a break-even)")
    parser.add_argument("--recheck", type=float, default=None, metavar="RATIO",
                        help="time again, alone and with 3x the steps, each model whose ampfx/best is above RATIO "
                             "(e.g. 1.10), and print both figures: a busy moment of the machine from the model's own")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "COMPILED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        try:
            res = run_case(args.one[0], args.dtype, args.reps, args.one[1] == "1", args.all_low, args.scale)
        except Exception:  # noqa: BLE001 - reported as the row's error
            res = {"model": args.one[0], "error": traceback.format_exc()[-1500:]}
        print("RESULT " + json.dumps(res, default=str))
        return
    import torch

    from ampfx.ops import device_cost
    from ampfx.policy.names import parse_dtype
    flags = set(next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), []))
    print(f"step time, {args.dtype}, CPU, one thread, median of {args.reps} interleaved steps after 2 warm-ups; "
          f"torch {torch.__version__}, python {sys.version.split()[0]}; trained at {args.scale}x the example's batch")
    print("CPU flags: " + (", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")
                                     if f in flags) or "none of avx2/avx512/amx"))
    torch.set_num_threads(1)
    be, where = device_cost.limits(None, None, "cpu", None, parse_dtype(args.dtype))
    print(f"ampfx's break-even here: {device_cost.describe(be)} ({where['flops']})")
    rows = []
    modes = [True] if args.compiled_only else [False, True] if args.compile else [False]
    for compiled in modes:
        for name in args.models.split(","):
            p = subprocess.run([sys.executable, __file__, "--one", name, str(int(compiled)), "--dtype", args.dtype,
                                "--reps", str(args.reps), "--scale", str(args.scale)]
                              + (["--all-low"] if args.all_low else []),
                               capture_output=True, text=True, timeout=3600)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(line[-1][7:]) if line else {"model": name, "error": p.stderr[-1500:]}
            res["compiled"] = compiled
            rows.append(res)
            if "error" in res:
                print(f"{name:24s} {'compiled' if compiled else 'eager':8s} ERROR {res['error'].splitlines()[-1]}",
                      flush=True)
                continue
            print(f"{name:24s} {'compiled' if compiled else 'eager':8s} float32 {res['float32_ms']:8.2f} ms  "
                  f"autocast {_ms(res, 'autocast')}  ampfx {res['ampfx_ms']:8.2f}  ampfx/autocast "
                  f"{_x(res['ratio'])}  ampfx/best {res['best_ratio']:5.2f}x  outside ATen: autocast "
                  f"{_ms(res, 'autocast_outside', 6)} ampfx {res['ampfx_outside_ms']:6.2f} ms  "
                  f"{'whole' if whole(res.get('capture')) else 'parts'}"
                  f"  small GEMMs float32 {res.get('small_gemms', 0)} of {res.get('gemm_nodes', 0)}"
                  f"  casts: autocast {res.get('autocast_casts', '-')} ampfx {res['ampfx_casts']}"
                  + (f"  every GEMM low {_ms(res, 'all_low')} ({_x(res['all_low_ratio'])})" if args.all_low else "")
                  + (f"  backend {_ms(res, 'backend')} ({_x(res['backend_ratio'])})" if compiled else ""),
                  flush=True)
            for tool in ("autocast", "all_low", "backend"):
                if f"{tool}_error" in res:
                    print(f"{'':33s} {tool} failed: {res[tool + '_error']}", flush=True)
    if args.recheck is not None:
        _recheck(args, rows)
    for compiled in modes:
        done = [r for r in rows if r["compiled"] == compiled and "ratio" in r]
        if not done:
            continue
        ratios = [r["ratio"] for r in done if r["ratio"] is not None]
        best = [r["best_ratio"] for r in done]
        more = [r["model"] for r in done if r["ampfx_casts"] > r.get("autocast_casts", math.inf)]
        failed = [r["model"] for r in done if "autocast_error" in r]
        if failed:
            print(f"{'compiled' if compiled else 'eager'}: autocast failed on {failed} (ampfx / best is over float32 "
                  "there; ampfx / autocast leaves them out)")
        print(f"{'compiled' if compiled else 'eager'}: casts a step, ampfx's default over autocast's: "
              f"{more or 'none'}")
        print(f"{'compiled' if compiled else 'eager'}: ampfx / min(float32, autocast): median "
              f"{statistics.median(best):.2f}x, above 1.10x: {[r['model'] for r in done if r['best_ratio'] > 1.10] or 'none'}")
        above = [r["model"] for r in done if (r["ratio"] or 0) > 1.05]
        whole_above = [r["model"] for r in done if whole(r.get("capture")) and (r["ratio"] or 0) > 1.0]
        print(f"{'compiled' if compiled else 'eager'}: {len(done)} models, median ampfx/autocast "
              f"{statistics.median(ratios):.2f}x, above 1.05x: {above or 'none'}; captured whole above 1.0x: "
              f"{whole_above or 'none'}"
              + (f"; the ampfx backend: median {_median(r['backend_ratio'] for r in done)}"
                 if compiled else "")
              + (f"; every GEMM low: median {_median(r['all_low_ratio'] for r in done)}"
                 if args.all_low else ""))
    Path("/tmp/step_time.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
