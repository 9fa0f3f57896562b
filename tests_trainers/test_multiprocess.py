"""The trainer integrations in two CPU processes (gloo, launched by torchrun): conversion at the first call on each
rank, the loss curve of the trainer's own bf16, one decision log, resume on both ranks, float16 with its scaler.
The runs are tests_trainers/multiproc.py; a launch that fails or runs past its timeout fails the test."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import gap

HERE = Path(__file__).resolve().parent
LAUNCH_TIMEOUT = 300


def launch(mode, out):
    """Both ranks' results of one two-process run of ``multiproc.py MODE``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "multiproc.py"), mode, str(out)]
    try:
        p = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{mode}: the two-process run passed its {LAUNCH_TIMEOUT} s timeout:\n{str(e.stderr)[-3000:]}")
    assert p.returncode == 0, f"{mode}: a rank failed:\n{p.stderr[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_accelerate_in_two_processes(tmp_path):
    """AmpfxAccelerator under torchrun: both ranks convert; the bf16 curve is as close to Accelerate's own bf16 as
    that is to float32; DDP keeps the ranks' parameters equal; float16 trains with its scaler (the same scale on both
    ranks); one decision log; save_state on both ranks, then load_state, gives the steps an unbroken run gives."""
    ranks = launch("accelerate", tmp_path)
    zero = ranks[0]
    for r in ranks:
        assert r["ampfx_bf16_converted"] and r["ampfx_bf16_world"] == 2 and r["ampfx_fp16_converted"]
        for name in ("fp32", "own_bf16", "ampfx_bf16", "ampfx_fp16"):
            assert r[f"{name}_checksum"] == pytest.approx(zero[f"{name}_checksum"], rel=1e-6), name
        assert r["resumed"] == pytest.approx(r["straight"], rel=1e-5)
    own = gap(zero["own_bf16"], zero["fp32"])
    assert gap(zero["ampfx_bf16"], zero["own_bf16"]) <= 2 * own + 1e-3
    assert gap(zero["ampfx_fp16"], zero["fp32"]) <= 2 * own + 1e-3
    assert ranks[1]["ampfx_fp16_scale"] == zero["ampfx_fp16_scale"] > 0
    saved = [p.parent.name for p in (tmp_path / "report").rglob("summary.txt")]
    assert saved == ["report"], saved


def test_hf_trainer_in_two_processes(tmp_path):
    """AmpfxTrainer under torchrun: both ranks convert; the loss curve is as close to the Trainer's own bf16 as
    that is to float32; float16 trains with its scaler (the same scale on both ranks); one decision log per run in
    output_dir/ampfx; each checkpoint holds its policy file, and both ranks resume from it to the last step."""
    ranks = launch("hf", tmp_path)
    zero = ranks[0]
    for r in ranks:
        assert r["ampfx_bf16_converted"] and r["ampfx_bf16_world"] == 2
        assert r["resumed_step"] == 8
        assert r["ampfx_bf16_checksum"] == pytest.approx(zero["ampfx_bf16_checksum"], rel=1e-6)
        assert r["ampfx_fp16_checksum"] == pytest.approx(zero["ampfx_fp16_checksum"], rel=1e-6)
        assert r["ampfx_fp16_scale"] == zero["ampfx_fp16_scale"] > 0
    own = gap(zero["own_bf16"], zero["fp32"])
    assert gap(zero["ampfx_bf16"], zero["own_bf16"]) <= 2 * own + 1e-3
    assert gap(zero["ampfx_fp16"], zero["fp32"]) <= 2 * own + 1e-3
    saved = sorted(p.parent.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("summary.txt"))
    assert saved == ["ampfx/ampfx-log", "fp16/ampfx-log"], saved
    assert (tmp_path / "ampfx" / "checkpoint-4" / "ampfx_policy.json").is_file()


def test_lightning_ddp_in_two_processes(tmp_path):
    """AmpfxPrecision with ``import lightning as L`` and DDP under torchrun: both ranks convert; the curve is as
    close to Lightning's bf16-mixed as that is to float32; float16 trains with its scaler; the ranks' parameters
    stay equal; one decision log per run (saving it asked Lightning for its log folder on rank 0 alone, a broadcast
    the other rank never joined: the run hung until the process group's timeout); both ranks resume from the last
    checkpoint."""
    ranks = launch("lightning", tmp_path)
    zero = ranks[0]
    for r in ranks:
        assert r["ampfx_bf16_converted"] and r["ampfx_bf16_world"] == 2 and r["resumed_epoch"] == 3
        for name in ("ampfx_bf16", "ampfx_fp16"):
            assert r[f"{name}_checksum"] == pytest.approx(zero[f"{name}_checksum"], rel=1e-6), name
    own = gap(zero["own_bf16"], zero["fp32"])
    assert gap(zero["ampfx_bf16"], zero["own_bf16"]) <= 2 * own + 1e-3
    assert gap(zero["ampfx_fp16"], zero["fp32"]) <= 2 * own + 1e-3
    saved = sorted(p.parent.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("summary.txt"))
    assert saved == ["ampfx/ampfx-log", "fp16/ampfx-log", "report"], saved
