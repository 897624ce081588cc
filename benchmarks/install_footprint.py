"""What `pip install syncwise` and each extra pull into a fresh virtual environment: packages and size on disk.

    python benchmarks/install_footprint.py [--extras report,hf,...] [--out benchmarks/results/install-footprint.json]

Each row is a fresh venv (no system site-packages) into which the CPU build of torch is installed first, as the
README's CPU path says (`pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu`; on this
project's machines pip's find-links already holds that wheel), then `pip install <repo>[extra]`. A CUDA machine's
torch is the user's own and is not counted. Sizes are `du` of the venv; packages are `pip list` less pip itself.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ["", "report", "hf", "lightning", "accelerate", "ft", "prometheus", "tensorboard", "wandb"]
TORCH = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_FROM = "cpu-index"


def _du_mb(path: Path) -> float:
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) / 1024


def _packages(py: Path) -> list[str]:
    out = subprocess.run([str(py), "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                         check=True).stdout
    return sorted(p["name"].lower() for p in json.loads(out) if p["name"].lower() not in ("pip", "setuptools"))


def measure(extra: str, work: Path) -> dict:
    venv = work / (extra or "core")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    t0 = time.perf_counter()
    # The CPU build first (the README's CPU path): from PyTorch's CPU index, or (--torch-from local) from pip's
    # configured find-links, where this project's machines keep the same wheel (their network reaches PyPI only).
    subprocess.run(pip + [TORCH] + ([] if TORCH_FROM == "local" else ["--index-url", CPU_INDEX]), check=True)
    base_mb = _du_mb(venv)
    target = f"{ROOT}[{extra}]" if extra else str(ROOT)
    subprocess.run(pip + [target], check=True)
    packages = _packages(py)
    cuda = [p for p in packages if p.startswith("nvidia-")]
    row = {"extra": extra or "(core)", "packages": len(packages), "venv_mb": round(_du_mb(venv), 1),
           "venv_mb_without_torch_step": round(_du_mb(venv) - base_mb, 1), "nvidia_wheels": len(cuda),
           "torch": subprocess.run([str(py), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                   text=True).stdout.strip(),
           "install_s": round(time.perf_counter() - t0, 1), "names": packages}
    subprocess.run(["rm", "-rf", str(venv)], check=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extras", default=",".join(e or "core" for e in EXTRAS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/install-footprint.json"))
    ap.add_argument("--torch-from", choices=("cpu-index", "local"), default="cpu-index",
                    help="where the CPU torch comes from: PyTorch's CPU index, or pip's find-links (local wheels)")
    args = ap.parse_args(argv)
    global TORCH_FROM
    TORCH_FROM = args.torch_from
    extras = ["" if e == "core" else e for e in args.extras.split(",") if e]
    rows = []
    with tempfile.TemporaryDirectory(prefix="syncwise-install-") as tmp:
        for extra in extras:
            row = measure(extra, Path(tmp))
            rows.append(row)
            print(f"{row['extra']:>12}: {row['packages']:3d} packages, {row['venv_mb']:7.0f} MB "
                  f"({row['venv_mb_without_torch_step']:.0f} MB besides torch's step), torch {row['torch']}, "
                  f"{row['nvidia_wheels']} NVIDIA wheels", flush=True)
    Path(args.out).write_text(json.dumps({"python": sys.version.split()[0], "os": os.uname().sysname,
                                          "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
