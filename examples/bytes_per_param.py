"""`python examples/bytes_per_param.py`: memory per parameter of FusedAdamW's precision modes, and what each
does to training.

One small BF16 model (an MLP regressing the outputs of a fixed random "teacher" MLP on Gaussian inputs:
synthetic data, nothing downloaded) is trained from the same weights, data order and seeds with
FusedAdamW in four modes:

- ``masters``: ``master_weights=True``: an FP32 master per param (4 bytes), BF16 model copy;
- ``remainder``: ``master_weights="remainder"``: the FP32 master is the BF16 param plus an int16
  remainder (2 bytes); the update is bit-identical to ``masters``;
- ``stochastic``: no master, the BF16 param written with stochastic rounding (``rounding="stochastic"``);
- ``nearest``: no master, the BF16 param written with round-to-nearest-even: updates below half a BF16
  step are lost.

The bytes per parameter are counted from the tensors themselves after training: the param and its
gradient, the master (FP32 master or int16 remainder) and the moments (plus each param's one-element
step counter, spread over its elements). The table is printed, and the loss curves are plotted to
``<out>/bytes_per_param.png`` (matplotlib, needed by this example only) with the numbers in
``<out>/bytes_per_param.json``.

Run from the repository root with mpfused importable (``PYTHONPATH=.`` for the in-place build).
``--quick``: a few steps, for the test.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from mpfused.optim import FusedAdamW

MODES = [
    ("masters", dict(master_weights=True)),
    ("remainder", dict(master_weights="remainder")),
    ("stochastic", dict(master_weights=False, rounding="stochastic", seed=1234)),
    ("nearest", dict(master_weights=False, rounding="nearest")),
]
DIM, HIDDEN, BATCH = 64, 256, 256
LR = 1e-4  # small enough that many of Adam's updates are below half a BF16 step of the weights


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, 1))


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    teacher = mlp(seed=100)
    g = torch.Generator().manual_seed(7)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            x = torch.randn(BATCH, DIM, generator=g)
            out.append((x, teacher(x) + 0.01 * torch.randn(BATCH, 1, generator=g)))
    return out


def bytes_per_param(model: nn.Module, opt: FusedAdamW) -> dict[str, float]:
    """Bytes per parameter by role, from the tensors the model and the optimizer hold."""
    numel = sum(p.numel() for p in model.parameters())
    parts = {"param": 0, "grad": 0, "master": 0, "moments": 0, "step": 0}
    for p in model.parameters():
        parts["param"] += p.numel() * p.element_size()
        if p.grad is not None:
            parts["grad"] += p.grad.numel() * p.grad.element_size()
        for key, t in opt.state[p].items():
            role = {"master_param": "master", "master_remainder": "master", "step": "step"}.get(key, "moments")
            parts[role] += t.numel() * t.element_size()
    out = {k: v / numel for k, v in parts.items()}
    out["total"] = sum(out.values())
    return out


def train(mode: dict, batches: list) -> tuple[list[float], dict[str, float]]:
    model = mlp(seed=0).to(torch.bfloat16)
    opt = FusedAdamW(model.parameters(), lr=LR, weight_decay=0.0, **mode)
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=False)  # keep the grads: they are part of the bytes counted
        loss = nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, bytes_per_param(model, opt)


def table(results: dict) -> str:
    head = f"{'mode':<11} {'param':>6} {'grad':>6} {'master':>7} {'moments':>8} {'step':>6} {'total':>6}  " \
           f"{'first loss':>10} {'final loss':>10}"
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        b = r["bytes_per_param"]
        final = sum(r["losses"][-10:]) / len(r["losses"][-10:])
        lines.append(f"{name:<11} {b['param']:>6.2f} {b['grad']:>6.2f} {b['master']:>7.2f} {b['moments']:>8.2f} "
                     f"{b['step']:>6.3f} {b['total']:>6.2f}  {r['losses'][0]:>10.3e} {final:>10.3e}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot(r["losses"], label=f"{name} ({r['bytes_per_param']['total']:.1f} B/param)", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE loss")
    ax.set_title(f"BF16 MLP, FusedAdamW lr {LR:g}: precision modes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="output folder (default demo_out/)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per mode (default 400)")
    parser.add_argument("--quick", action="store_true", help="20 steps: a smoke run")
    args = parser.parse_args(argv)
    if args.quick and args.steps is not None:
        parser.error("--quick runs 20 steps: give --quick or --steps, not both")
    steps = 20 if args.quick else 400 if args.steps is None else args.steps
    if steps < 1:
        parser.error("--steps must be >= 1")
    try:  # the output folder now, not after the training (a bad --out lost it)
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {args.out}: {e.strerror or e}")
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    start = time.perf_counter()
    batches = data(steps)
    results = {}
    for name, mode in MODES:
        losses, b = train(mode, batches)
        results[name] = {"mode": {k: v for k, v in mode.items()}, "losses": losses, "bytes_per_param": b}
    print(f"FusedAdamW on a BF16 MLP ({sum(p.numel() for p in mlp(0).parameters()):,} params), {steps} steps, "
          f"lr {LR:g}; bytes per param counted from the tensors; final loss = mean of the last 10 steps")
    print(table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / "bytes_per_param.png")
    (args.out / "bytes_per_param.json").write_text(json.dumps({"steps": steps, "lr": LR, "results": results}, indent=1))
    print(f"wrote {args.out / 'bytes_per_param.png'} and {args.out / 'bytes_per_param.json'} "
          f"({time.perf_counter() - start:.1f} s)")
    return results


if __name__ == "__main__":
    main()
