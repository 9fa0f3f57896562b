"""benchmarks/gpu.py starts and prints its tables on tiny sizes (the CPU smoke mode CI runs; no GPU needed)."""
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    # tiny sizes: every GEMM low, as on a GPU (on a CPU each would be under the break-even and stay float32)
    env = {**os.environ, "AMPFX_GEMM_MIN_FLOPS": "0"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env)


def test_smoke_mode_prints_every_run_of_every_model_and_the_gemm_table():
    run = _run("--smoke", "--models", "gpt2,resnet50,vit", "--dtypes", "bf16,fp16", "--reps", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "ampfx GPU suite (smoke" in out and "torch " in out and "device cpu" in out
    for model in ("gpt2", "resnet50", "vit"):
        rows = [line.split() for line in out.splitlines() if line.startswith(model)]
        runs = [" ".join(r[1:-5]) for r in rows]
        assert runs == ["fp32", "autocast bfloat16", "ampfx bfloat16", "autocast float16", "ampfx float16"], runs
        assert all(float(r[-4]) > 0 for r in rows)  # a step time was measured
    accum = [line.split() for line in out.splitlines() if line.startswith("accum gpt2")]
    assert [(r[2], " ".join(r[3:-5])) for r in accum] == [
        ("4", f"{how} {dtype}") for dtype in ("bfloat16", "float16")
        for how in ("autocast", "ampfx cache", "ampfx")], accum  # gradient accumulation: 4 micro-batches a step
    assert all(float(r[-4]) > 0 for r in accum)
    fp8 = [line.split() for line in out.splitlines() if line.startswith("fp8 gpt2")]
    assert [" ".join(r[2:4]) for r in fp8][:2] == ["ampfx bf16", "ampfx fp8"] and all(float(r[-4]) > 0 for r in fp8)
    assert "FP8 (tensorwise): " in out  # the smoke run puts linears in FP8 (every size)
    gemm = [line for line in out.splitlines() if "->" in line and "GEMM" not in line]
    assert len(gemm) == 6 and any("float16" in line for line in gemm)


def test_an_unknown_model_is_named():
    run = _run("--smoke", "--models", "gpt3")
    assert run.returncode == 2 and "unknown model 'gpt3'" in run.stderr


def test_cpu_mode_keeps_the_cpu_models_and_bf16():
    """--cpu (without compile here: inductor's first build takes minutes) prints the transformer and CNN rows
    in bf16 and no GEMM table."""
    run = _run("--cpu", "--no-compile", "--reps", "1")
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split()[:3] for line in run.stdout.splitlines() if line.startswith(("gpt2", "resnet50"))]
    assert {r[0] for r in rows} == {"gpt2", "resnet50"} and "GEMM" not in run.stdout
    assert all(r[1] == "fp32" or r[2] == "bfloat16" for r in rows)
