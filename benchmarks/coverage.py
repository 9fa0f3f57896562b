"""Coverage (not a test): real models through convert + one training step, per dtype.

Models from torchvision, timm, HF transformers and diffusers built from configs with random
init (no downloads), plus torch.nn's LSTM, GRU and Transformer. Per model and dtype it prints
the capture path, nodes converted, casts per training step and megabytes written by all ops
per step against torch.autocast (loss inside the region), the eval-mode output error against
FP32, and the status. Every GEMM is low (``gemm_min_flops=0``): the models are built small, and on a CPU
ampfx would keep most of their GEMMs float32 by default (under the device's break-even), which is not the plan
a model of training size gets. Needs its own environment (torchvision does not import beside the core
lane's torch 2.13; the test lane's .venv-models plus diffusers will do):

    python3 -m venv /tmp/venv-models
    /tmp/venv-models/bin/pip install torch==2.14.1 torchvision==0.29.1
    /tmp/venv-models/bin/pip install timm "transformers==4.57.*" "diffusers==0.35.*" "huggingface-hub<1.0"
    /tmp/venv-models/bin/pip install -e .
    /tmp/venv-models/bin/python benchmarks/coverage.py            # everything (a subprocess per case)
    /tmp/venv-models/bin/python benchmarks/coverage.py --one hf_t5 bf16
    /tmp/venv-models/bin/python benchmarks/coverage.py --compile [models...]   # bf16, and a compiled step of each

Results go to stdout and /tmp/probe_results.json; the last run is recorded in docs/coverage.md.
"""
import os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import families  # noqa: E402 - beside this script

MODELS = ["tv_resnet18", "tv_mobilenet_v3_small", "tv_efficientnet_b0", "tv_vit_b_16", "tv_convnext_tiny",
          "timm_resnet18", "timm_vit_tiny", "timm_deit_tiny", "timm_mobilenetv3_small_050", "timm_efficientnet_b0",
          "hf_bert_seqcls", "hf_gpt2_lm", "hf_roberta", "hf_distilbert", "hf_t5",
          "hf_gpt2_lm_nocache", "hf_t5_nocache", "hf_llama_nocache", "hf_bart_nocache", "hf_vit", "hf_albert",
          "timm_convnext_atto", "timm_swin_tiny", "tv_regnet_y_400mf", "tv_densenet121",
          "tv_r3d_18", "diffusers_unet2d", "nn_lstm_cls", "nn_gru_cls", "nn_transformer",
          "timm_mobilevit_xxs", "timm_efficientvit_m0",  # conv/attention hybrids: slow exports, many parts
          *families.FAMILIES]
DTYPES = ["bf16", "fp16"]
B, S, V, NC = 2, 16, 1000, 10
CONVERT_S = 10.0
"""Seconds a conversion may take, in either mode, before its row is flagged."""


def as_after_an_optimizer_step(model):
    """The state a training step starts from: no gradients, and every weight just written (as an optimizer step
    writes it), so the step measured makes its low weight copies as every step of training does. Without the
    write the weight cache (on by default) would reuse copies made by an earlier call, and the step would count
    fewer casts than training makes."""
    import torch
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0)


def build(name):
    import torch
    import torch.nn as nn
    g = torch.Generator().manual_seed(0)
    img = lambda hw: torch.randn(B, 3, hw, hw, generator=g)
    tgt = torch.randint(0, NC, (B,), generator=g)
    if name == "tv_r3d_18":  # video: conv3d, batch norm 3-d, adaptive 3-d pooling
        import torchvision.models.video as tvv
        return tvv.r3d_18(num_classes=NC), (torch.randn(B, 3, 4, 32, 32, generator=g),), ("ce", tgt)
    if name == "diffusers_unet2d":  # group norm, SiLU, attention, nearest upsampling, sinusoidal timesteps
        import diffusers
        m = diffusers.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                                  block_out_channels=(32, 64), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                  up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8)
        noise = torch.randn(B, 3, 16, 16, generator=g)
        return m, (torch.randn(B, 3, 16, 16, generator=g), torch.tensor([10, 500])), ("mse", noise)
    if name.startswith("tv_"):
        import torchvision.models as tvm
        arch = name[3:]
        if arch == "vit_b_16":
            m = tvm.vit_b_16(num_classes=NC, image_size=32)
            torch.nn.init.normal_(m.heads.head.weight, std=0.02)  # zero-init head would make logits == bias == 0
            x = img(32)
        else:
            m = getattr(tvm, arch)(num_classes=NC)
            x = img(64)
        return m, (x,), ("ce", tgt)
    if name.startswith("timm_"):
        import timm
        arch = {"timm_resnet18": "resnet18", "timm_vit_tiny": "vit_tiny_patch16_224",
                "timm_deit_tiny": "deit_tiny_patch16_224", "timm_mobilenetv3_small_050": "mobilenetv3_small_050",
                "timm_efficientnet_b0": "efficientnet_b0", "timm_convnext_atto": "convnext_atto",
                "timm_swin_tiny": "swin_tiny_patch4_window7_224", "timm_mobilevit_xxs": "mobilevit_xxs",
                "timm_efficientvit_m0": "efficientvit_m0"}[name]
        kw = {"img_size": 64} if ("vit" in arch or "deit" in arch) and "mobilevit" not in arch else {}
        if "swin" in arch:
            kw = {"img_size": 64, "window_size": 2}  # 64 px: 16, 8, 4, 2 patches a side per stage
        m = timm.create_model(arch, pretrained=False, num_classes=NC, **kw)
        return m, (img(64),), ("ce", tgt)
    if name.endswith("_nocache"):
        m, inp, spec = build(name[:-8])
        return m, {**inp, "use_cache": False}, spec
    if name.startswith("hf_"):
        import transformers as tf
        ids = torch.randint(0, V, (B, S), generator=g)
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, -4:] = 0
        if name == "hf_bert_seqcls":
            cfg = tf.BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=128, max_position_embeddings=64, num_labels=NC)
            m = tf.BertForSequenceClassification(cfg)
            return m, {"input_ids": ids, "attention_mask": mask, "labels": tgt}, ("hf", None)
        if name == "hf_gpt2_lm":
            cfg = tf.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=2, n_positions=64)
            m = tf.GPT2LMHeadModel(cfg)
            return m, {"input_ids": ids, "attention_mask": mask, "labels": ids}, ("hf", None)
        if name == "hf_roberta":
            cfg = tf.RobertaConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=128, max_position_embeddings=64)
            m = tf.RobertaModel(cfg)
            return m, {"input_ids": ids, "attention_mask": mask}, ("ce_hidden", torch.randint(0, 64, (B, S), generator=g))
        if name == "hf_distilbert":
            cfg = tf.DistilBertConfig(vocab_size=V, dim=64, n_layers=2, n_heads=2, hidden_dim=128,
                                      max_position_embeddings=64)
            m = tf.DistilBertModel(cfg)
            return m, {"input_ids": ids, "attention_mask": mask}, ("ce_hidden", torch.randint(0, 64, (B, S), generator=g))
        if name == "hf_llama":
            cfg = tf.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
            m = tf.LlamaForCausalLM(cfg)
            return m, {"input_ids": ids, "attention_mask": mask, "labels": ids}, ("hf", None)
        if name == "hf_bart":
            cfg = tf.BartConfig(vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                max_position_embeddings=64)
            m = tf.BartForConditionalGeneration(cfg)
            labels = torch.randint(3, V, (B, S), generator=g)
            return m, {"input_ids": ids, "attention_mask": mask, "labels": labels}, ("hf", None)
        if name == "hf_vit":
            cfg = tf.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=128, num_labels=NC)
            m = tf.ViTForImageClassification(cfg)
            return m, {"pixel_values": img(32), "labels": tgt}, ("hf", None)
        if name == "hf_albert":
            cfg = tf.AlbertConfig(vocab_size=V, embedding_size=32, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=128, max_position_embeddings=64,
                                  num_labels=NC)
            m = tf.AlbertForSequenceClassification(cfg)
            return m, {"input_ids": ids, "attention_mask": mask, "labels": tgt}, ("hf", None)
        if name == "hf_t5":
            cfg = tf.T5Config(vocab_size=V, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_decoder_layers=2,
                              num_heads=2, decoder_start_token_id=0, pad_token_id=0)
            m = tf.T5ForConditionalGeneration(cfg)
            labels = torch.randint(1, V, (B, S), generator=g)
            return m, {"input_ids": ids, "attention_mask": mask, "labels": labels}, ("hf", None)
    if name == "nn_lstm_cls":
        class LSTMClassifier(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(V, 64)
                self.lstm = nn.LSTM(64, 64, num_layers=2, batch_first=True)
                self.head = nn.Linear(64, NC)

            def forward(self, ids):
                h, _ = self.lstm(self.emb(ids))
                return self.head(h[:, -1])
        ids = torch.randint(0, V, (B, S), generator=g)
        return LSTMClassifier(), (ids,), ("ce", tgt)
    if name == "nn_gru_cls":
        class GRUClassifier(nn.Module):
            def __init__(self):
                super().__init__()
                self.gru = nn.GRU(16, 64, num_layers=2, batch_first=True, bidirectional=True)
                self.head = nn.Linear(128, NC)

            def forward(self, x):
                h, _ = self.gru(x)
                return self.head(h.mean(1))
        return GRUClassifier(), (torch.randn(B, S, 16, generator=g),), ("ce", tgt)
    if name == "nn_transformer":
        m = nn.Transformer(d_model=64, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=128,
                           batch_first=True)
        src = torch.randn(B, S, 64, generator=g)
        tg = torch.randn(B, S, 64, generator=g)
        return m, (src, tg), ("ce_hidden", torch.randint(0, 64, (B, S), generator=g))
    if name in families.FAMILIES:
        return families.build(name)
    raise KeyError(name)


def primary(out):
    import torch
    if isinstance(out, torch.Tensor):
        return out
    for k in ("logits", "last_hidden_state", "sample"):
        v = out.get(k) if isinstance(out, dict) else getattr(out, k, None)
        if v is not None:
            return v
    if isinstance(out, (tuple, list)):
        return primary(out[0])
    if isinstance(out, dict):
        return next(v for v in out.values() if isinstance(v, torch.Tensor))
    raise TypeError(f"no primary output in {type(out)}")


def loss_of(out, spec):
    import torch
    import torch.nn.functional as F
    own = families.loss_of(out, spec)
    if own is not None:
        return own
    kind, tgt = spec
    if kind == "hf":
        loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
        if loss is None:
            loss = out[0]
        return loss.float()
    logits = primary(out).float()
    if kind == "mse":
        return F.mse_loss(logits, tgt)
    if kind == "ce":
        return F.cross_entropy(logits, tgt)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def call(m, inp):
    return m(**inp) if isinstance(inp, dict) else m(*inp)


def run_case(name, dt):
    import torch
    import ampfx
    from ampfx.tools.measure import measure_step, saved_bytes
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    r = {"model": name, "dtype": dt, "status": "ok", "problems": [], "errors": []}
    try:
        model, inp, spec = build(name)
    except Exception:
        r["status"] = "build-error"
        r["errors"].append({"stage": "build", "tb": traceback.format_exc()})
        return r
    model.train()
    # FP32 reference: which params get grads
    try:
        model.zero_grad(set_to_none=True)
        loss_of(call(model, inp), spec).backward()
        ref_grad = {n for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        r["fp32_params_with_grad"] = len(ref_grad)
    except Exception:
        r["errors"].append({"stage": "fp32-ref", "tb": traceback.format_exc()})
        ref_grad = None
    # convert
    try:
        t0 = time.perf_counter()
        amp = ampfx.convert(model, dtype, example_inputs=inp, gemm_min_flops=0)
        r["convert_s"] = round(time.perf_counter() - t0, 2)
    except Exception:
        r["status"] = "convert-error"
        r["errors"].append({"stage": "convert", "tb": traceback.format_exc()})
        return r
    try:  # the other conversion mode, timed as well (an inference copy of the weights; the model in eval mode)
        model.eval()
        t0 = time.perf_counter()
        ampfx.convert(model, dtype, example_inputs=inp, mode="inference", gemm_min_flops=0)
        r["convert_inference_s"] = round(time.perf_counter() - t0, 2)
    except Exception:
        r["errors"].append({"stage": "convert-inference", "tb": traceback.format_exc()})
    finally:
        model.train()
    for key in ("convert_s", "convert_inference_s"):
        if r.get(key, 0) > CONVERT_S:
            r["problems"].append(f"{key} {r[key]} > {CONVERT_S} s")
    rep = amp.ampfx_report
    r["summary"] = rep.summary()
    r["methods"] = [(reg.path, reg.method) for reg in rep.parts]
    r["leaves"] = [p for reg in rep.parts for p, _ in reg.leaves]
    r["leaf_reasons"] = {p: why for reg in rep.parts for p, why in reg.leaves}
    r["steps"] = [list(reg.steps) for reg in rep.parts]
    r["converted"] = len(rep.low())
    r["total"] = len(rep.compute)
    r["n_casts_inserted"] = len(rep.casts)
    r["notes"] = list(rep.notes)
    # train step
    try:
        amp.train()
        model.zero_grad(set_to_none=True)
        out = call(amp, inp)
        loss = loss_of(out, spec)
        r["loss"] = float(loss)
        if not torch.isfinite(loss):
            r["problems"].append("non-finite loss")
        loss.backward()
        got = {n for n, p in model.named_parameters() if p.grad is not None}
        nonfinite = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        r["params_with_grad"] = len(got)
        r["params_total"] = sum(1 for _ in model.parameters())
        if not got:
            r["problems"].append("no gradients on original params")
        elif ref_grad is not None and got != ref_grad:
            r["problems"].append(f"grad set differs from fp32: missing {sorted(ref_grad - got)[:5]} "
                                 f"({len(ref_grad - got)}), extra {len(got - ref_grad)}")
        if nonfinite:
            r["problems"].append(f"non-finite grads in {len(nonfinite)} params e.g. {nonfinite[:3]}")
        amp_grads = [p.grad for p in amp.parameters() if p.grad is not None]
        r["amp_params_with_grad"] = len(amp_grads)
        model.zero_grad(set_to_none=True)
    except Exception:
        r["status"] = "train-error"
        r["errors"].append({"stage": "train-step", "tb": traceback.format_exc()})
    # eval comparison
    try:
        model.eval()
        amp.eval()
        with torch.no_grad():
            ref = primary(call(model, inp)).float()
            got_out = primary(call(amp, inp))
        r["out_dtype"] = str(got_out.dtype)
        got_out = got_out.float()
        err = (got_out - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
        r["rel_err"] = err
        try:
            with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
                ac_out = primary(call(model, inp)).float()
            r["rel_err_autocast"] = (ac_out - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
        except Exception as e:  # noqa: BLE001 - autocast itself fails on some ops (fp16 LSTM on CPU)
            r["rel_err_autocast"] = None
            r["autocast_eval_error"] = str(e)[:200]
        lim = 0.05 if dt == "bf16" else 0.01
        if not (err <= lim):
            r["problems"].append(f"rel err {err:.3g} > {lim}")
    except Exception:
        r["status"] = "eval-error" if r["status"] == "ok" else r["status"]
        r["errors"].append({"stage": "eval", "tb": traceback.format_exc()})
    # casts
    try:
        model.train()
        amp.train()

        def step_amp():
            loss_of(call(amp, inp), spec).backward()

        def step_ac():
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_of(call(model, inp), spec)
            loss.backward()
        as_after_an_optimizer_step(model)
        torch.manual_seed(0)
        ours = measure_step(step_amp)
        r["casts_ampfx"], r["mb_ampfx"] = ours.count, ours.written / 2**20
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        try:
            theirs = measure_step(step_ac)
            r["casts_autocast"], r["mb_autocast"] = theirs.count, theirs.written / 2**20
        except Exception:
            r["autocast_baseline_error"] = traceback.format_exc()[-600:]
            r["casts_autocast"] = None
        model.zero_grad(set_to_none=True)
        for key, step in (("saved_mb_ampfx", step_amp), ("saved_mb_autocast", step_ac)):
            as_after_an_optimizer_step(model)
            torch.manual_seed(0)
            try:
                r[key] = saved_bytes(step) / 2**20
            except Exception:  # noqa: BLE001 - autocast fails on some models
                r[key] = None
            model.zero_grad(set_to_none=True)
        if r.get("saved_mb_autocast") is not None and r["saved_mb_ampfx"] > 1.01 * r["saved_mb_autocast"]:
            r["problems"].append(f"saves {r['saved_mb_ampfx']:.3g} MB for backward > autocast "
                                 f"{r['saved_mb_autocast']:.3g} MB")
        if r["casts_autocast"] is not None and r["casts_ampfx"] > r["casts_autocast"]:
            r["problems"].append(f"casts {r['casts_ampfx']} > autocast {r['casts_autocast']}")
        if r.get("mb_autocast") is not None and r["mb_ampfx"] > 1.01 * r["mb_autocast"]:  # > 1% more
            r["problems"].append(f"writes {r['mb_ampfx']:.3g} MB > autocast {r['mb_autocast']:.3g} MB")
    except Exception:
        r["errors"].append({"stage": "casts", "tb": traceback.format_exc()})
    if COMPILE:
        r["compile"] = compiled_steps(model, amp, inp, spec, dtype)
        if r["compile"]["autocast"] == "ok" and r["compile"]["ampfx"] != "ok":
            r["problems"].append(f"ampfx + compile fails where autocast + compile trains: {r['compile']['ampfx']}")
    if root_left_eager(r["methods"]):
        r["problems"].append("root left eager")
    if r.get("total") and r["converted"] == 0:
        r["problems"].append("nothing converted")
    if r["status"] == "ok" and (r["problems"] or r["errors"]):
        r["status"] = "suspicious" if not r["errors"] else "error"
    return r


COMPILE = os.environ.get("COVERAGE_COMPILE") == "1"
"""``--compile``: also a training step of each tool under ``torch.compile`` (inductor): does it train?"""


def compiled_steps(model, amp, inp, spec, dtype):
    """A training step (float32 loss, backward) of ``torch.compile`` over the model under autocast and over ampfx's
    conversion: ``"ok"`` or the error's first line, per tool."""
    import torch
    out = {}
    for tool in ("autocast", "ampfx"):
        torch._dynamo.reset()
        model.train()
        model.zero_grad(set_to_none=True)
        try:
            run = torch.compile(model if tool == "autocast" else amp)
            if tool == "autocast":
                with torch.autocast("cpu", dtype=dtype):
                    loss = loss_of(call(run, inp), spec)
            else:
                loss = loss_of(call(run, inp), spec)
            loss.backward()
            out[tool] = "ok" if torch.isfinite(loss) else "non-finite loss"
        except Exception as e:  # noqa: BLE001 - the row says what failed
            out[tool] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
    model.zero_grad(set_to_none=True)
    return out


def fmt(x, digits=2):
    return "n/a" if x is None else f"{x:.{digits}g}"


def root_method(methods):
    """How the root was captured, from the report's ``(path, method)`` parts: the root is the part
    at path ``""``, listed after its children (``None`` without one)."""
    return next((how for path, how in methods if path == ""), None)


def root_left_eager(methods):
    """Whether the root ran as eager Python (only its children converted): a "suspicious" row."""
    return (root_method(methods) or "").startswith("eager")


def capture(res):
    """How the root was captured, and how many parts were converted separately."""
    methods = res.get("methods") or []
    if not methods:
        return "-"
    root = root_method(methods) or methods[0][1]
    parts = sum(1 for path, how in methods if path and not how.startswith("left as is"))
    return root + (f" + {parts} parts" if parts else "")


def main():
    only = sys.argv[1:]
    cases = [(m, d) for m in MODELS for d in (["bf16"] if COMPILE else DTYPES) if not only or m in only]
    results = []
    from concurrent.futures import ThreadPoolExecutor

    def one(case):
        m, d = case
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, __file__, "--one", m, d], capture_output=True, text=True,
                               timeout=2700 if COMPILE else 900)
            line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            if line:
                res = json.loads(line[-1][7:])
            else:
                res = {"model": m, "dtype": d, "status": "crash", "errors": [{"stage": "process", "tb": p.stderr[-4000:]}]}
        except subprocess.TimeoutExpired:
            res = {"model": m, "dtype": d, "status": "timeout", "errors": []}
        res["wall_s"] = round(time.time() - t0, 1)
        print(f"{m:28s} {d} {res['status']:14s} {capture(res):34s} {res.get('converted')}/{res.get('total')} "
              f"casts {res.get('casts_ampfx')}/{res.get('casts_autocast')} "
              f"MB {fmt(res.get('mb_ampfx'), 3)}/{fmt(res.get('mb_autocast'), 3)} "
              f"saved {fmt(res.get('saved_mb_ampfx'), 3)}/{fmt(res.get('saved_mb_autocast'), 3)} "
              f"convert {res.get('convert_s')} s (inference {res.get('convert_inference_s')} s) err {fmt(res.get('rel_err'))} "
              f"(autocast {fmt(res.get('rel_err_autocast'))}) "
              f"{'compile ' + str(res['compile']) + ' ' if 'compile' in res else ''}{res.get('problems') or ''}",
              flush=True)
        return res
    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(one, cases))
    print("\n| model | dtype | capture | convert s train / inference | converted | casts ampfx / autocast | MB written ampfx / autocast "
          "| MB saved for backward ampfx / autocast | error ampfx / autocast | status |" + (" compile autocast / ampfx |" if COMPILE else ""))
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if COMPILE else ""))
    for res in sorted(results, key=lambda r: (r["model"], r["dtype"])):
        casts = f"{res.get('casts_ampfx')} / {res.get('casts_autocast') or 'n/a (autocast fails)'}"
        errs = f"{fmt(res.get('rel_err'))} / {fmt(res.get('rel_err_autocast'))}"
        mb = f"{fmt(res.get('mb_ampfx'), 3)} / {fmt(res.get('mb_autocast'), 3)}"
        saved = f"{fmt(res.get('saved_mb_ampfx'), 3)} / {fmt(res.get('saved_mb_autocast'), 3)}"
        status = res["status"] + (": " + "; ".join(res.get("problems") or []) if res.get("problems") else "")
        seconds = f"{fmt(res.get('convert_s'), 3)} / {fmt(res.get('convert_inference_s'), 3)}"
        print(f"| {res['model']} | {res['dtype']} | {capture(res)} | {seconds} "
              f"| {res.get('converted')}/{res.get('total')} | {casts} | {mb} | {saved} | {errs} | {status} |" +
              (f" {res.get('compile', {}).get('autocast', 'n/a')} / {res.get('compile', {}).get('ampfx', 'n/a')} |"
               if COMPILE else ""))
    out = "/tmp/probe_results.json" if not only else f"/tmp/probe_results_{'_'.join(only)}.json"
    json.dump(results, open(out, "w"), indent=1, default=str)


if __name__ == "__main__":
    if "--compile" in sys.argv:  # read by every case's subprocess
        sys.argv.remove("--compile")
        os.environ["COVERAGE_COMPILE"] = "1"
        COMPILE = True
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        res = run_case(sys.argv[2], sys.argv[3])
        print("RESULT " + json.dumps(res, default=str))
    else:
        main()
