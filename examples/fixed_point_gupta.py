"""`python examples/fixed_point_gupta.py`: training in 16-bit fixed point with round-to-nearest and with
stochastic rounding, after Gupta et al., "Deep Learning with Limited Numerical Precision" (ICML 2015).

A 64-100-10 MLP (ReLU) learns scikit-learn's handwritten digits (sklearn.datasets.load_digits: 1797 8x8
images that ship with the package; nothing is downloaded; pixels scaled to [0, 1]; a fixed 80/20 split).
It is trained with plain minibatch SGD, the same initial weights, data order and learning rate, in:

- FP32 (nn.Linear + torch.optim.SGD), the baseline;
- fixed point <16 - FL, FL> for several FL, where the weights, the activations and the gradients are all
  held in that format (mpfused.fixed_point.FixedPointLinear: the input activation, the MACC's output, the
  output gradient and the input/weight/bias gradients are converted; mpfused.fixed_point.FixedPointSGD:
  the weights are re-converted after every update), once with round-to-nearest and once with stochastic
  rounding everywhere.

The loss (softmax cross-entropy) is computed in FP32 from the fixed-point logits, as the paper's last
layer does. The script prints a table of the final test error per setting and the ratio of the typical
weight update lr * |g| (measured in the FP32 run's first epoch) to each format's grid step 2^-FL: under
round-to-nearest, an update smaller than half a step is lost. The curves go to <out>/fixed_point_gupta.png
(matplotlib) and everything to <out>/fixed_point_gupta.json.

Run from the repository root after `make build`: `PYTHONPATH=. python examples/fixed_point_gupta.py`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mpfused import fixed_point as fxp

WL = 16
CONFIGS = {
    "full": dict(hidden=100, batch=32, lr=0.1, epochs=20, fls=(8, 10, 12, 14)),
    "quick": dict(hidden=100, batch=32, lr=0.1, epochs=3, fls=(8, 14)),
}
ROUNDINGS = ("nearest", "stochastic")


# ---- data ---------------------------------------------------------------------------------------------
def load_data(seed: int = 0):
    """Digits as float32 tensors: (x_train, y_train, x_test, y_test), pixels / 16 in [0, 1], a fixed
    80/20 split drawn with ``seed``."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = len(y) // 5
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


# ---- models -------------------------------------------------------------------------------------------
def make_model(kind: str, hidden: int, seed: int, fl: int = 0, rounding: str = "nearest") -> nn.Module:
    """FP32 (``kind`` "fp32") or fixed point <WL - fl, fl> with ``rounding``; the same initial weights
    for a given seed (the fixed-point ones rounded to the nearest grid value)."""
    torch.manual_seed(seed)
    if kind == "fp32":
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    fmt = fxp.FixedPointFormat(WL - fl, fl)
    return nn.Sequential(fxp.FixedPointLinear(64, hidden, fmt, rounding=rounding, seed=seed * 16 + 1), nn.ReLU(),
                         fxp.FixedPointLinear(hidden, 10, fmt, rounding=rounding, seed=seed * 16 + 2))


def make_optimizer(model: nn.Module, kind: str, lr: float, seed: int, fl: int = 0, rounding: str = "nearest"):
    if kind == "fp32":
        return torch.optim.SGD(model.parameters(), lr=lr)
    return fxp.FixedPointSGD(model.parameters(), lr=lr, fmt=(WL - fl, fl), rounding=rounding, seed=seed * 16 + 3)


def test_error(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) != y).float().mean().item()


def train(kind: str, cfg: dict, data, seed: int = 0, fl: int = 0, rounding: str = "nearest",
          record_updates: bool = False) -> dict:
    """One run: per-epoch test error and mean training loss. With ``record_updates`` (FP32), also the
    weight updates lr * |g| of the first epoch (their median and quantiles)."""
    x_tr, y_tr, x_te, y_te = data
    model = make_model(kind, cfg["hidden"], seed, fl, rounding)
    opt = make_optimizer(model, kind, cfg["lr"], seed, fl, rounding)
    order = torch.Generator().manual_seed(seed + 100)
    errors, losses, updates = [test_error(model, x_te, y_te)], [], []
    t0 = time.perf_counter()
    for epoch in range(cfg["epochs"]):
        perm = torch.randperm(len(y_tr), generator=order)
        total, batches = 0.0, 0
        for i in range(0, len(perm), cfg["batch"]):
            idx = perm[i:i + cfg["batch"]]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x_tr[idx]).float(), y_tr[idx])
            loss.backward()
            if record_updates and epoch == 0:
                updates.append(torch.cat([cfg["lr"] * p.grad.detach().abs().flatten() for p in model.parameters()
                                          if p.dim() == 2]))
            opt.step()
            total, batches = total + loss.item(), batches + 1
        losses.append(total / batches)
        errors.append(test_error(model, x_te, y_te))
    name = "FP32" if kind == "fp32" else f"<{WL - fl},{fl}> {rounding}"
    out = {"name": name, "kind": kind, "fl": fl if kind != "fp32" else None, "rounding": rounding if kind != "fp32" else None,
           "test_error": errors, "train_loss": losses, "final_test_error": errors[-1], "seconds": time.perf_counter() - t0}
    if updates:
        u = torch.cat(updates).double()
        nz = u[u > 0]
        out["update_stats"] = {"median": nz.median().item(), "q90": nz.quantile(0.9).item() if nz.numel() < 2**24 else None,
                               "zero_fraction": 1 - nz.numel() / u.numel(), "values": u}
    return out


def update_ratios(stats: dict, fls) -> list:
    """For each FL: the median update over the grid step, and the fraction of updates below half a step
    (which round-to-nearest of the weight drops, from a weight on the grid)."""
    u = stats["values"]
    rows = []
    for fl in fls:
        step = 2.0 ** -fl
        rows.append({"fl": fl, "grid_step": step, "median_update_over_step": stats["median"] / step,
                     "fraction_below_half_step": (u < step / 2).double().mean().item()})
    return rows


def run_all(cfg: dict, seed: int = 0, progress=print) -> dict:
    """Every setting of ``cfg``: FP32, then each FL with each rounding."""
    data = load_data(seed)
    runs = [train("fp32", cfg, data, seed, record_updates=True)]
    progress(f"  {runs[0]['name']:24s} final test error {100 * runs[0]['final_test_error']:5.2f}%  "
             f"({runs[0]['seconds']:.1f} s)")
    for fl in cfg["fls"]:
        for rounding in ROUNDINGS:
            r = train("fixed", cfg, data, seed, fl, rounding)
            runs.append(r)
            progress(f"  {r['name']:24s} final test error {100 * r['final_test_error']:5.2f}%  ({r['seconds']:.1f} s)")
    stats = runs[0].pop("update_stats")
    ratios = update_ratios(stats, cfg["fls"])
    del stats["values"]
    return {"config": cfg, "seed": seed, "wl": WL, "n_train": len(data[1]), "n_test": len(data[3]), "runs": runs,
            "update_stats": stats, "update_ratios": ratios}


def print_table(res: dict) -> None:
    by = {(r["fl"], r["rounding"]): r for r in res["runs"]}
    fp32 = res["runs"][0]
    print(f"\nFinal test error after {res['config']['epochs']} epochs ({res['n_test']} test images), WL = {WL}:")
    print(f"  {'format':>10s}  {'nearest':>9s}  {'stochastic':>10s}  {'median lr|g| / 2^-FL':>21s}  {'updates < step/2':>16s}")
    print(f"  {'FP32':>10s}  {100 * fp32['final_test_error']:8.2f}%  {'':>10s}")
    for row in res["update_ratios"]:
        fl = row["fl"]
        print(f"  {f'<{WL - fl},{fl}>':>10s}  {100 * by[(fl, 'nearest')]['final_test_error']:8.2f}%  "
              f"{100 * by[(fl, 'stochastic')]['final_test_error']:9.2f}%  {row['median_update_over_step']:21.3g}  "
              f"{100 * row['fraction_below_half_step']:15.1f}%")
    s = res["update_stats"]
    print(f"  (weight updates lr*|g| in FP32's first epoch: median {s['median']:.3g}, {100 * s['zero_fraction']:.1f}% zero)")


def plot_curves(ax_by_rounding: dict, res: dict) -> None:
    """Test error per epoch: one axis per rounding, FP32 on each."""
    fp32 = res["runs"][0]
    colors = {fl: c for fl, c in zip(res["config"]["fls"], ("tab:red", "tab:orange", "tab:green", "tab:blue"))}
    for rounding, ax in ax_by_rounding.items():
        ax.plot(range(len(fp32["test_error"])), [100 * e for e in fp32["test_error"]], color="black", lw=2, label="FP32")
        for r in res["runs"][1:]:
            if r["rounding"] == rounding:
                ax.plot(range(len(r["test_error"])), [100 * e for e in r["test_error"]], color=colors.get(r["fl"]),
                        label=f"<{WL - r['fl']},{r['fl']}>")
        ax.set_xlabel("epoch")
        ax.set_ylabel("test error, %")
        ax.set_ylim(0, 100)
        ax.set_title(f"Digits MLP, WL={WL} fixed point, {rounding} rounding")
        ax.legend(fontsize=7)


def write_plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    plot_curves({"nearest": axes[0], "stochastic": axes[1]}, res)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def check_seed_and_out(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--seed and --out, checked before any training (this script's and the demo's): a seed in [0, 2**32),
    so that the seeds derived from it stay in the generators' range, and the output folder made now (a bad
    --out, or a negative seed, once failed after the training, its results lost)."""
    if not 0 <= args.seed < 2**32:  # (seeds derived from it must stay in the generators' range)
        p.error(f"--seed must be in [0, 2**32), got {args.seed}")
    try:  # the output folder now, not after the training (a bad --out lost it)
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {args.out}: {e.strerror or e}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python examples/fixed_point_gupta.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 epochs, FL 8 and 14 (for tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="demo_out", help="folder for the PNG and JSON (default: ./demo_out)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: the matrices are 32 x 100; more threads only wait on each other)")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error("--threads must be at least 1")
    check_seed_and_out(p, args)
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(before)


def _main(args) -> dict:
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    t0 = time.perf_counter()
    print(f"MLP 64-{cfg['hidden']}-10 on sklearn digits, SGD lr {cfg['lr']}, batch {cfg['batch']}, {cfg['epochs']} "
          f"epochs, seed {args.seed}; {torch.get_num_threads()} torch threads")
    res = run_all(cfg, args.seed)
    print_table(res)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = out / "fixed_point_gupta.png"
    res["figure"] = str(png) if write_plot(res, png) else None
    res["seconds_total"] = time.perf_counter() - t0
    (out / "fixed_point_gupta.json").write_text(json.dumps(res, indent=1))
    print(f"\nwritten to {out}/: fixed_point_gupta.json{', fixed_point_gupta.png' if res['figure'] else ''} "
          f"({res['seconds_total']:.1f} s)")
    return res


if __name__ == "__main__":
    main()
