"""The wheel: built from a copy of the checkout, installed into a fresh virtual environment (torch 2.13 first,
then the wheel, no editable install), it runs ``ampfx demo`` from a folder outside the repository."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, cwd, env=None):
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_wheel_installs_into_a_fresh_venv_and_runs_the_demo(tmp_path):
    """python -m build makes one wheel holding every package (ampfx.passes from passes/, the integrations);
    pip installs it beside torch 2.13 into a new venv; ampfx demo runs there, importing the installed copy."""
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv*", ".git", "build", "dist", "*.egg-info",
                                                                "__pycache__", ".pytest_cache"))
    run([sys.executable, "-m", "build", "--wheel", "--outdir", tmp_path / "dist", source], cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("ampfx-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("ampfx/passes/paint.py", "ampfx/ui/cli.py", "ampfx/integrations/lightning.py",
              "ampfx/integrations/accelerate.py", "ampfx/integrations/hf.py", "ampfx/integrations/lazy.py"):
        assert f in names, f
    assert not any(n.startswith(("passes/", "tests", "conftest")) for n in names)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    for extra in ("dgl", "ui", "lightning", "hf"):
        assert f"Provides-Extra: {extra}" in metadata

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    py = venv / "bin" / "python"
    run([py, "-m", "pip", "install", "-q", "torch==2.13.0"], cwd=tmp_path)
    run([py, "-m", "pip", "install", "-q", "torch==2.13.0", wheel], cwd=tmp_path)
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = run([py, "-c", "import ampfx; print(ampfx.__file__)"], cwd=away, env=env)
    assert str(venv) in where and str(ROOT) not in where
    out = run([venv / "bin" / "ampfx", "demo", "--steps", "5"], cwd=away, env=env)
    assert "ampfx: converted" in out
