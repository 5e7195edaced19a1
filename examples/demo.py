"""`python examples/demo.py`: what each mixed-precision technique buys, measured on a real model.

A character-level language model (an MLP over the previous bytes, built from nn.Linear, LayerNorm and
GELU) learns to predict the next byte of the Python standard library's own source code: real data that
ships with every Python, nothing is downloaded. The same model, data order and seed are trained five
times through ``mpfused.amp.initialize``: O0 (FP32), O1 (autocast), O2 (FP16 model, FP32 masters,
dynamic loss scaling), O3 (pure FP16) and "O2 without loss scaling". On the way, the O2 run measures
the three effects of the mixed-precision paper (Micikevicius et al., ICLR 2018):

1. gradient underflow: the FP16 gradients of the real FP16 backward, against the FP32 gradients of the
   same weights (the master copy) on the same batch: how many nonzero values flush to zero with and
   without the loss scale, and the log2 histogram of their magnitudes against FP16's limits;
2. the loss curves of O2 with dynamic loss scaling against O0 and against O2 without scaling;
3. lost updates: the fraction of the real O2 weight updates (new master - old master) that change
   nothing when added to the FP16 weights, against the FP32 master copy.

A last panel trains in 16-bit fixed point (Gupta et al., ICML 2015) with round-to-nearest and with
stochastic rounding: the functions of examples/fixed_point_gupta.py on scikit-learn's digits (skipped,
with a note, when scikit-learn is not installed).

Everything printed, and more, goes to ``<out>/demo.json``; the figure to ``<out>/demo.png`` (with
matplotlib, a dependency of this demo only, not of mpfused).

Run it from the repository root after ``make build`` as ``make demo``, or with mpfused importable
(``PYTHONPATH=.`` for the in-place build, or an installed mpfused) as ``python examples/demo.py``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mpfused

# The fixed-point panel reuses examples/fixed_point_gupta.py (a script beside this one, not a package).
_FPG_SPEC = importlib.util.spec_from_file_location("fixed_point_gupta", Path(__file__).resolve().parent /
                                                   "fixed_point_gupta.py")
fixed_point_gupta = importlib.util.module_from_spec(_FPG_SPEC)
_FPG_SPEC.loader.exec_module(fixed_point_gupta)

# Training text: the source of standard-library modules (plain Python, shipped with CPython). The
# held-out text is other modules, so the held-out loss measures what generalises.
TRAIN_FILES = ["_pydecimal.py", "inspect.py", "typing.py", "argparse.py", "tarfile.py", "difflib.py",
               "pickletools.py", "zipfile.py", "datetime.py", "subprocess.py"]
HELDOUT_FILES = ["calendar.py", "textwrap.py", "shutil.py"]

CONFIGS = {
    # context bytes, embedding width, hidden width, hidden layers, tokens (next-byte predictions) per step
    "full": dict(ctx=16, emb=16, hidden=256, layers=2, tokens=4096, steps=240, lr=3e-3, warmup=10,
                 weight_decay=0.01, eval_every=40, eval_tokens=8192, probes=4),
    "quick": dict(ctx=8, emb=8, hidden=64, layers=2, tokens=1024, steps=30, lr=1e-2, warmup=3,
                  weight_decay=0.01, eval_every=10, eval_tokens=2048, probes=2),
}
RUNS = [  # (name, opt_level, loss_scale override)
    ("O0", "O0", None),
    ("O1", "O1", None),
    ("O2", "O2", None),
    ("O3", "O3", None),
    ("O2 no scaling", "O2", 1.0),
]

FP16 = torch.finfo(torch.float16)
LOG2_MIN_SUBNORMAL = -24   # 2^-24: the smallest FP16 subnormal; |x| <= 2^-25 rounds to zero
LOG2_MIN_NORMAL = -14      # 2^-14: the smallest FP16 normal number
LOG2_MAX = math.log2(FP16.max)  # 65504 = 2^15.999: larger values overflow to inf
LOST_RATIO = 2.0 ** -11    # |update / weight| below this: the update is below half an FP16 ulp of the weight


# ---- data -------------------------------------------------------------------------------------------
def load_text(files) -> bytes:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = [(stdlib / f).read_bytes() for f in files if (stdlib / f).is_file()]
    if not parts:
        raise RuntimeError(f"none of {files} found under {stdlib} (is the standard library's source installed?)")
    return b"\n".join(parts)


def windows(data: torch.Tensor, starts: torch.Tensor, ctx: int):
    """Inputs (the ``ctx`` previous bytes) and targets (the next byte) at the given start offsets."""
    idx = starts[:, None] + torch.arange(ctx + 1)
    w = data[idx]
    return w[:, :-1], w[:, -1]


# ---- model ------------------------------------------------------------------------------------------
class CharMLP(nn.Module):
    """Next-byte prediction from the previous ``ctx`` bytes: byte embedding, then ``layers`` blocks of
    Linear -> LayerNorm -> GELU, then a Linear head over the 256 byte values."""

    def __init__(self, ctx: int, emb: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(256, emb)
        blocks, width = [], ctx * emb
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.GELU()]
            width = hidden
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(width, 256)

    def forward(self, x):
        return self.head(self.body(self.embed(x).flatten(1)))


def low_precision_linears(model: nn.Module) -> str:
    """The GEMM the O1/O2/O3 runs use for their FP16 linears: mpfused's own (in place; the Parameter
    objects are kept, so the optimizer and amp.initialize see the same weights)."""
    mpfused.nn.convert_linear(model)
    return "mpfused.nn.FusedLinear (mpfused's GEMM: FP16/BF16 in, FP32 accumulate)"


# ---- measurements -----------------------------------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ActivationGrads:
    """Captures the gradient of the loss with respect to every Linear output and the embedding output
    (the activation gradients of the paper's histogram), in the dtype autograd stores them in."""

    def __init__(self, model: nn.Module):
        self.grads: dict[str, torch.Tensor] = {}
        self.handles = []
        for name, m in model.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding, mpfused.nn.FusedLinear)):
                self.handles.append(m.register_forward_hook(self._hook(name)))

    def _hook(self, name):
        def fwd(module, args, out):
            out.register_hook(lambda g: self.grads.__setitem__(name, g.detach().clone()))
        return fwd

    def remove(self):
        for h in self.handles:
            h.remove()


def backward_grads(model, x, y, scale: float):
    """Activation and weight gradients of ``scale * loss`` on (x, y), as stored (no unscaling)."""
    model.zero_grad(set_to_none=True)
    cap = ActivationGrads(model)
    try:
        loss = F.cross_entropy(model(x).float(), y)
        (loss * scale).backward()
    finally:
        cap.remove()
    weights = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return cap.grads, weights


def underflow_counts(ref: dict, low: dict) -> dict:
    """Of the values nonzero in the FP32 reference: how many are zero in the low-precision backward
    (flushed), and how many landed below FP16's smallest normal (subnormal: fewer significant bits)."""
    nonzero = flushed = subnormal = 0
    for k, r in ref.items():
        lo = low[k]
        nz = r != 0
        nonzero += int(nz.sum())
        flushed += int((nz & (lo == 0)).sum())
        subnormal += int(((lo != 0) & (lo.float().abs() < FP16.tiny)).sum())
    return {"nonzero_fp32": nonzero, "flushed": flushed, "flushed_frac": flushed / max(nonzero, 1),
            "subnormal": subnormal, "subnormal_frac": subnormal / max(nonzero, 1)}


def log2_histogram(tensors, lo: int = -48, hi: int = 4) -> dict:
    """Counts of log2|g| over unit bins [k, k+1) for k in [lo, hi), plus zeros and the values outside."""
    edges = torch.arange(lo, hi + 1, dtype=torch.float32)
    counts = torch.zeros(hi - lo, dtype=torch.int64)
    zeros = below = above = 0
    for t in tensors:
        a = t.detach().float().abs().flatten().cpu()
        zeros += int((a == 0).sum())
        lg = torch.log2(a[a > 0])
        below += int((lg < lo).sum())
        above += int((lg >= hi).sum())
        inside = lg[(lg >= lo) & (lg < hi)]
        counts += torch.bincount((inside.floor() - lo).long(), minlength=hi - lo)
    return {"log2_edges": edges.tolist(), "counts": counts.tolist(), "zeros": zeros, "below": below, "above": above}


def grad_probe(model, ref_model, x, y, scale: float) -> dict:
    """Effect 1 on the current O2 weights: the FP32 gradients (ref_model holds the FP32 masters) against
    the real FP16 backward without scaling and with the loss scale the run is using."""
    ref_act, ref_w = backward_grads(ref_model, x, y, 1.0)
    lo_act1, lo_w1 = backward_grads(model, x, y, 1.0)
    lo_actS, lo_wS = backward_grads(model, x, y, scale)
    return {
        "scale": scale,
        "activation_grads": {"unscaled": underflow_counts(ref_act, lo_act1), "scaled": underflow_counts(ref_act, lo_actS),
                             "histogram_fp32": log2_histogram(ref_act.values())},
        "weight_grads": {"unscaled": underflow_counts(ref_w, lo_w1), "scaled": underflow_counts(ref_w, lo_wS),
                         "histogram_fp32": log2_histogram(ref_w.values())},
    }


def lost_updates(old_master: list, new_master: list, dtype: torch.dtype) -> dict:
    """Effect 3 on one real O2 step: u = new master - old master (exact in FP32, the two are close).
    Applied to the low-precision weight w = old master rounded to dtype, in FP32 with one rounding (as
    an optimizer without master copies would), does it change w? And applied to the FP32 master?"""
    changed = lost_low = lost_fp32 = below_ratio = 0
    for old, new in zip(old_master, new_master):
        u = new - old
        moved = u != 0
        w = old.to(dtype)
        changed += int(moved.sum())
        lost_low += int((moved & ((w.float() + u).to(dtype) == w)).sum())
        lost_fp32 += int((moved & ((old + u) == old)).sum())
        below_ratio += int((moved & (u.abs() < LOST_RATIO * old.abs())).sum())
    n = max(changed, 1)
    return {"updated_elements": changed, "lost_low_precision": lost_low, "lost_low_precision_frac": lost_low / n,
            "lost_fp32_master": lost_fp32, "lost_fp32_master_frac": lost_fp32 / n,
            "ratio_below_2^-11": below_ratio, "ratio_below_2^-11_frac": below_ratio / n}


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@torch.no_grad()
def evaluate(model, x, y, chunk: int) -> tuple[float, float]:
    """Held-out mean cross-entropy (nats per byte) and next-byte accuracy."""
    loss = correct = 0.0
    for i in range(0, x.shape[0], chunk):
        logits = model(x[i:i + chunk]).float()
        loss += float(F.cross_entropy(logits, y[i:i + chunk], reduction="sum"))
        correct += float((logits.argmax(-1) == y[i:i + chunk]).sum())
    return loss / x.shape[0], correct / x.shape[0]


# ---- one run ----------------------------------------------------------------------------------------
def train_run(name, opt_level, loss_scale, base_model, cfg, data, heldout, device, seed, probe, progress):
    model = copy.deepcopy(base_model).to(device)
    linear_impl = "torch nn.Linear (FP32)" if opt_level == "O0" else low_precision_linears(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    model, opt, scaler = mpfused.amp.initialize(model, opt, opt_level, loss_scale=loss_scale)
    props = mpfused.amp.properties(model)

    steps = cfg["steps"]
    gen = torch.Generator().manual_seed(seed)  # the same batches, in the same order, for every run
    losses = torch.zeros(steps, dtype=torch.float32, device=device)
    probe_steps = set(probe["steps"]) if probe else set()
    probes, evals, scales = [], [], []
    step_seconds = 0.0
    bar = _progress(steps, name) if progress else None

    def lr_at(i):  # linear warm-up, then cosine decay to 10%
        if i < cfg["warmup"]:
            return cfg["lr"] * (i + 1) / cfg["warmup"]
        t = (i - cfg["warmup"]) / max(steps - cfg["warmup"], 1)
        return cfg["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    for i in range(steps):
        starts = torch.randint(0, data.numel() - cfg["ctx"] - 1, (cfg["tokens"],), generator=gen)
        x, y = (t.to(device, non_blocking=True) for t in windows(data, starts, cfg["ctx"]))
        for group in opt.param_groups:
            group["lr"] = lr_at(i)
        measure = i in probe_steps
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        if measure:  # effect 3: the masters before the step (outside the timed region)
            _sync(device)
            step_seconds += time.perf_counter() - t0
            masters = [opt.state[p]["master_param"].clone() if "master_param" in opt.state[p] else None
                       for p in model.parameters()]
            t0 = time.perf_counter()
        scaler.step(opt)
        scaler.update()
        losses[i] = loss.detach()
        _sync(device)
        step_seconds += time.perf_counter() - t0

        if measure:
            rec = {"step": i + 1, "skipped": scaler.last_step_skipped}
            pairs = [(m, opt.state[p]["master_param"]) for m, p in zip(masters, model.parameters()) if m is not None]
            if pairs and not rec["skipped"]:
                rec["lost_updates"] = lost_updates([a for a, _ in pairs], [b for _, b in pairs], props.dtype)
            ref = probe["ref_model"]
            with torch.no_grad():
                ref_params = dict(ref.named_parameters())
                for n, p in model.named_parameters():
                    st = opt.state[p]
                    ref_params[n].copy_(st["master_param"] if "master_param" in st else p.float())
            rec.update(grad_probe(model, ref, probe["x"], probe["y"], scaler.get_scale()))
            probes.append(rec)
        if (i + 1) % cfg["eval_every"] == 0 or i + 1 == steps:
            ev_loss, ev_acc = evaluate(model, heldout[0], heldout[1], cfg["tokens"])
            evals.append({"step": i + 1, "loss": ev_loss, "accuracy": ev_acc})
            scales.append({"step": i + 1, "scale": scaler.get_scale()})
            if bar is not None:
                bar.set_postfix(train=f"{float(loss.detach()):.3f}", heldout=f"{ev_loss:.3f}", scale=f"{scaler.get_scale():g}")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    losses = losses.cpu().tolist()
    tail = max(1, steps // 10)
    state = [t for s in opt.state.values() for t in s.values()]
    return {
        "name": name, "opt_level": opt_level, "amp": props.as_dict(), "linear": linear_impl,
        "param_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()}),
        "final_train_loss": sum(losses[-tail:]) / tail, "final_train_loss_window": tail,
        "heldout_loss": evals[-1]["loss"], "heldout_accuracy": evals[-1]["accuracy"],
        "ms_per_step": 1e3 * step_seconds / steps,
        "weight_bytes": nbytes(list(model.parameters()) + list(model.buffers())),
        "optimizer_state_bytes": nbytes(state),
        "skipped_steps": scaler.skipped_steps, "scaler_enabled": scaler.is_enabled(),
        "final_loss_scale": scaler.get_scale(),
        "train_losses": losses, "evals": evals, "loss_scales": scales, "probes": probes,
    }


def _progress(total, name):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=f"{name:>13}", unit="step", file=sys.stderr, dynamic_ncols=True, leave=True)


# ---- summaries --------------------------------------------------------------------------------------
def smooth(values, window):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def summarize(runs, cfg):
    by = {r["name"]: r for r in runs}
    o0, o2, o2n = by["O0"], by["O2"], by["O2 no scaling"]
    w = max(1, cfg["steps"] // 20)
    s0, s2, s2n = (smooth(r["train_losses"], w) for r in (o0, o2, o2n))
    half = len(s0) // 2
    tracking = {
        "smoothing_window": w,
        "O2_vs_O0_mean_abs_gap_second_half": sum(abs(a - b) for a, b in zip(s2[half:], s0[half:])) / (len(s0) - half),
        "O2_no_scaling_vs_O0_mean_abs_gap_second_half":
            sum(abs(a - b) for a, b in zip(s2n[half:], s0[half:])) / (len(s0) - half),
        "O2_no_scaling_above_O0_fraction_second_half":
            sum(a > b for a, b in zip(s2n[half:], s0[half:])) / (len(s0) - half),
        "O2_minus_O0_heldout": o2["heldout_loss"] - o0["heldout_loss"],
        "O2_no_scaling_minus_O0_heldout": o2n["heldout_loss"] - o0["heldout_loss"],
    }
    probes = [p for p in o2["probes"]]
    under = {}
    for kind in ("activation_grads", "weight_grads"):
        under[kind] = {mode: {
            "flushed_frac_mean": sum(p[kind][mode]["flushed_frac"] for p in probes) / len(probes),
            "subnormal_frac_mean": sum(p[kind][mode]["subnormal_frac"] for p in probes) / len(probes),
            "flushed_frac_per_probe": [p[kind][mode]["flushed_frac"] for p in probes],
        } for mode in ("unscaled", "scaled")}
    lost = [p["lost_updates"] for p in probes if "lost_updates" in p]
    lost_summary = {
        "probe_steps": [p["step"] for p in probes if "lost_updates" in p],
        "lost_low_precision_frac": [d["lost_low_precision_frac"] for d in lost],
        "lost_fp32_master_frac": [d["lost_fp32_master_frac"] for d in lost],
        "ratio_below_2^-11_frac": [d["ratio_below_2^-11_frac"] for d in lost],
    }
    return {"underflow": under, "loss_tracking": tracking, "lost_updates": lost_summary,
            "probe_steps": [p["step"] for p in probes], "probe_scales": [p["scale"] for p in probes]}


TABLE_FIELDS = ["final_train_loss", "heldout_loss", "heldout_accuracy", "ms_per_step", "weight_bytes",
                "optimizer_state_bytes", "skipped_steps", "final_loss_scale"]


def print_table(runs):
    headers = ["run", "params", "train loss", "held-out loss", "held-out acc", "ms/step", "weights",
               "opt state", "skipped", "final scale"]
    rows = []
    for r in runs:
        rows.append([r["name"], "/".join(d.replace("float", "fp").replace("bfp16", "bf16") for d in r["param_dtypes"]),
                     f"{r['final_train_loss']:.4f}", f"{r['heldout_loss']:.4f}", f"{100 * r['heldout_accuracy']:.2f}%",
                     f"{r['ms_per_step']:.1f}", f"{r['weight_bytes'] / 2**20:.2f} MiB",
                     f"{r['optimizer_state_bytes'] / 2**20:.2f} MiB",
                     str(r["skipped_steps"]) if r["scaler_enabled"] else "- (off)",
                     f"{r['final_loss_scale']:g}" if r["scaler_enabled"] else "1 (off)"])
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        for row in rows:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 140))
    table = Table(*headers)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def print_effects(res):
    s = res["summary"]
    u = s["underflow"]
    print("\n1. Gradient underflow (O2 weights at steps "
          f"{s['probe_steps']}, loss scales {[f'{x:g}' for x in s['probe_scales']]}; real FP16 backward vs FP32 "
          "backward of the same weights, fixed batch):")
    for kind, label in (("activation_grads", "activation gradients"), ("weight_grads", "weight gradients")):
        a, b = u[kind]["unscaled"], u[kind]["scaled"]
        print(f"   {label:21s}: flushed to zero {100 * a['flushed_frac_mean']:7.3f}% without scaling, "
              f"{100 * b['flushed_frac_mean']:7.3f}% with it; subnormal {100 * a['subnormal_frac_mean']:6.2f}% vs "
              f"{100 * b['subnormal_frac_mean']:6.2f}%")
    t = s["loss_tracking"]
    print("2. Loss curves (training loss smoothed over "
          f"{t['smoothing_window']} steps, mean |gap| to O0 over the second half): O2 {t['O2_vs_O0_mean_abs_gap_second_half']:.4f}, "
          f"O2 without scaling {t['O2_no_scaling_vs_O0_mean_abs_gap_second_half']:.4f}; held-out loss minus O0's: "
          f"O2 {t['O2_minus_O0_heldout']:+.4f}, O2 without scaling {t['O2_no_scaling_minus_O0_heldout']:+.4f}")
    print(f"   {res['verdicts']['loss_curves']}")
    lu = s["lost_updates"]
    if lu["probe_steps"]:
        pct = lambda xs: ", ".join(f"{100 * v:.2f}%" for v in xs)  # noqa: E731
        print(f"3. Lost updates (real O2 updates at steps {lu['probe_steps']}): applied to FP16 weights "
              f"{pct(lu['lost_low_precision_frac'])} change nothing (|update/weight| < 2^-11: "
              f"{pct(lu['ratio_below_2^-11_frac'])}); applied to the FP32 master: {pct(lu['lost_fp32_master_frac'])}")


def verdicts(summary, runs):
    """Plain statements computed from the measurements by the rule stated in them (nothing is tuned to
    force an outcome): the no-scaling gap counts as an effect when it is more than twice both O2's gap and
    the O1-O0 gap (another sound mixed-precision path, a measure of run-to-run numerical noise)."""
    t = summary["loss_tracking"]
    by = {r["name"]: r for r in runs}
    floor = abs(by["O1"]["heldout_loss"] - by["O0"]["heldout_loss"])
    gap, gap_n = abs(t["O2_minus_O0_heldout"]), t["O2_no_scaling_minus_O0_heldout"]
    above = t["O2_no_scaling_above_O0_fraction_second_half"]
    rel = gap_n / by["O0"]["heldout_loss"]
    if gap_n > 2 * max(gap, floor) and gap_n > 0:
        curve = (f"Without loss scaling O2 ends {gap_n:.4f} nats/byte ({100 * rel:.2f}%) above O0 on held-out text, "
                 f"against {gap:.4f} with dynamic scaling (O1 vs O0: {floor:.4f}); its smoothed training loss is above "
                 f"O0's on {100 * above:.0f}% of the second half's steps. A small but systematic cost at this length "
                 "of training.")
    else:
        curve = (f"The effect on the loss is weak on this run: O2 without scaling ends {gap_n:+.4f} nats/byte from "
                 f"O0 on held-out text, O2 with scaling {t['O2_minus_O0_heldout']:+.4f} (O1 vs O0: {floor:.4f}); "
                 "the underflow measured above is real, but at this length of training it does not show in the loss.")
    return {"loss_curves": curve, "rule": "effect if gap(no scaling) > 2 * max(|gap(O2)|, |O1 - O0|)",
            "noise_floor_O1_vs_O0_heldout": floor}


# ---- figure -----------------------------------------------------------------------------------------
def write_figure(res, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = {r["name"]: r for r in res["runs"]}
    summary = res["summary"]
    styles = {"O0": dict(color="black", lw=2), "O1": dict(color="tab:green", lw=1),
              "O2": dict(color="tab:blue", lw=1.5), "O3": dict(color="tab:purple", lw=1),
              "O2 no scaling": dict(color="tab:red", lw=1.5)}
    w = summary["loss_tracking"]["smoothing_window"]
    fig, axes = plt.subplots(3, 3, figsize=(18, 14))

    # 1: histogram of the FP32 activation-gradient magnitudes at the last probe, unscaled and scaled.
    ax = axes[0][0]
    probe = runs["O2"]["probes"][-1]
    act = probe["activation_grads"]
    h = act["histogram_fp32"]
    centers = [e + 0.5 for e in h["log2_edges"][:-1]]
    total = max(sum(h["counts"]) + h["below"] + h["above"], 1)
    frac = [c / total for c in h["counts"]]
    shift = math.log2(probe["scale"])
    ax.bar(centers, frac, width=1.0, alpha=0.55, color="tab:blue",
           label=f"FP32 gradients: {100 * act['unscaled']['flushed_frac']:.1f}% are 0 in the FP16 backward")
    if shift:
        ax.bar([c + shift for c in centers], frac, width=1.0, alpha=0.45, color="tab:orange",
               label=f"x loss scale {probe['scale']:g}: {100 * act['scaled']['flushed_frac']:.3f}% are 0")
    ax.axvspan(h["log2_edges"][0], LOG2_MIN_SUBNORMAL - 1, color="red", alpha=0.07, label="rounds to 0 in FP16")
    ax.axvline(LOG2_MIN_SUBNORMAL, color="red", ls="--", lw=1, label="FP16 smallest subnormal 2^-24")
    ax.axvline(LOG2_MIN_NORMAL, color="darkorange", ls="--", lw=1, label="FP16 smallest normal 2^-14")
    ax.axvline(LOG2_MAX, color="black", ls=":", lw=1, label="FP16 largest 65504")
    ax.set_xlabel("log2 |gradient of the loss w.r.t. a layer output|")
    ax.set_ylabel("fraction of nonzero values")
    ax.set_title(f"1. Activation gradients, O2 step {probe['step']}")
    ax.legend(fontsize=7, loc="upper left")

    # 1b: the flushed fractions at every probe.
    ax = axes[1][0]
    for kind, label, color in (("activation_grads", "activation grads", "tab:blue"),
                               ("weight_grads", "weight grads", "tab:green")):
        u = summary["underflow"][kind]
        ax.plot(summary["probe_steps"], [100 * v for v in u["unscaled"]["flushed_frac_per_probe"]], "o-",
                color=color, label=f"{label}, no scaling")
        ax.plot(summary["probe_steps"], [100 * v for v in u["scaled"]["flushed_frac_per_probe"]], "s--",
                color=color, alpha=0.6, label=f"{label}, with the loss scale")
    ax.set_xlabel("O2 step")
    ax.set_ylabel("% of nonzero FP32 gradients that are 0 in FP16")
    ax.set_title("1. Gradient underflow over training")
    ax.legend(fontsize=7)

    # 2: loss curves, and their gap to O0.
    ax = axes[0][1]
    for name, style in styles.items():
        r = runs[name]
        ax.plot(range(1, len(r["train_losses"]) + 1), smooth(r["train_losses"], w), label=name, **style)
    ax.plot([e["step"] for e in runs["O0"]["evals"]], [e["loss"] for e in runs["O0"]["evals"]], "o", ms=4,
            color="black", label="O0 held-out")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss, nats/byte (mean of {w} steps)")
    ax.set_title("2. Loss curves")
    ax.legend(fontsize=7)
    ax = axes[1][1]
    base = smooth(runs["O0"]["train_losses"], w)
    for name, style in styles.items():
        if name == "O0":
            continue
        r = runs[name]
        gap = [a - b for a, b in zip(smooth(r["train_losses"], w), base)]
        ax.plot(range(1, len(gap) + 1), gap, label=f"{name} train", **style)
        ax.plot([e["step"] for e in r["evals"]],
                [e["loss"] - f["loss"] for e, f in zip(r["evals"], runs["O0"]["evals"])], "o", ms=4,
                color=style["color"])
    ax.axhline(0, color="black", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss minus O0's (dots: held-out)")
    ax.set_title("2. Gap to the FP32 baseline: O2 with vs without loss scaling")
    ax.legend(fontsize=7)

    # 3: lost updates.
    ax = axes[0][2]
    lu = summary["lost_updates"]
    xs = list(range(len(lu["probe_steps"])))
    ax.bar([x - 0.2 for x in xs], [100 * v for v in lu["lost_low_precision_frac"]], width=0.4, color="tab:red",
           label="added to the FP16 weights")
    ax.bar([x + 0.2 for x in xs], [100 * v for v in lu["lost_fp32_master_frac"]], width=0.4, color="tab:blue",
           label="added to the FP32 master copy")
    ax.plot(xs, [100 * v for v in lu["ratio_below_2^-11_frac"]], "k_", ms=20, mew=2,
            label="|update / weight| < 2^-11")
    ax.set_xticks(xs, [str(s) for s in lu["probe_steps"]])
    ax.set_xlabel("O2 step (lr decays along a cosine)")
    ax.set_ylabel("% of the step's weight updates that change nothing")
    ax.set_title("3. Lost weight updates")
    ax.legend(fontsize=7)

    # The table's cost side: bytes and time per step.
    ax = axes[1][2]
    names = list(styles)
    ys = range(len(names))
    weights = [runs[n]["weight_bytes"] / 2**20 for n in names]
    state = [runs[n]["optimizer_state_bytes"] / 2**20 for n in names]
    ax.barh(ys, weights, color="tab:gray", label="weights")
    ax.barh(ys, state, left=weights, color="tab:olive", label="optimizer state (moments, FP32 masters)")
    for y, n in zip(ys, names):
        ax.text(weights[y] + state[y], y, f"  {runs[n]['ms_per_step']:.0f} ms/step", va="center", fontsize=8)
    ax.set_yticks(list(ys), names)
    ax.invert_yaxis()
    ax.set_xlabel("MiB")
    ax.set_title(f"Memory and time per step ({res['device']})")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_xlim(right=1.45 * max(a + b for a, b in zip(weights, state)))

    # 4: fixed point (Gupta et al.): test error curves per rounding, and the final errors per format.
    fp = res.get("fixed_point")
    if fp is not None:
        fixed_point_gupta.plot_curves({"nearest": axes[2][0], "stochastic": axes[2][1]}, fp)
        ax = axes[2][2]
        by = {(r["fl"], r["rounding"]): r for r in fp["runs"]}
        fls = fp["config"]["fls"]
        xs = list(range(len(fls)))
        for k, (rounding, color) in enumerate((("nearest", "tab:red"), ("stochastic", "tab:blue"))):
            ax.bar([x + (k - 0.5) * 0.4 for x in xs], [100 * by[(fl, rounding)]["final_test_error"] for fl in fls],
                   width=0.4, color=color, label=rounding)
        ax.axhline(100 * fp["runs"][0]["final_test_error"], color="black", lw=1.5, label="FP32")
        ax.set_xticks(xs, [f"<{fp['wl'] - fl},{fl}>" for fl in fls])
        ax.set_ylabel("final test error, %")
        ax.set_title(f"Fixed point, WL={fp['wl']}: after {fp['config']['epochs']} epochs")
        ax.legend(fontsize=7)
    else:
        for ax in axes[2]:
            ax.text(0.5, 0.5, "fixed-point panel skipped (scikit-learn not installed)", ha="center", transform=ax.transAxes)
            ax.set_axis_off()

    fig.suptitle(f"mpfused demo: character-level LM on Python stdlib source, {res['device']}, "
                 f"{res['config']['steps']} steps x {res['config']['tokens']} predictions, seed {res['seed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _json_safe(obj):
    """Non-finite floats (a diverged run's loss) become null: the JSON stays standard."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def fixed_point_panel(quick: bool, seed: int):
    """The digits MLP in 16-bit fixed point (examples/fixed_point_gupta.py), on the CPU with one torch
    thread (its matrices are 32 x 100); None when scikit-learn is missing."""
    try:
        import sklearn  # noqa: F401
    except ImportError:
        print("fixed-point panel skipped: scikit-learn is not installed (pip install scikit-learn)")
        return None
    cfg = dict(fixed_point_gupta.CONFIGS["quick" if quick else "full"])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        print(f"fixed point: digits MLP, {cfg['epochs']} epochs per setting")
        return fixed_point_gupta.run_all(cfg, seed, progress=print)
    finally:
        torch.set_num_threads(before)


# ---- main -------------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(prog="python examples/demo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model and few steps (for tests; seconds)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="demo_out", help="folder for demo.json and demo.png (default: ./demo_out)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    fixed_point_gupta.check_seed_and_out(p, args)

    t_start = time.perf_counter()
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    device = torch.device("cuda" if torch.cuda.is_available() and mpfused.has_cuda_kernels() else "cpu")
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    if args.steps is not None:
        if args.steps < 2:
            p.error("--steps must be at least 2")
        cfg["steps"] = args.steps
    train_text, held_text = load_text(TRAIN_FILES), load_text(HELDOUT_FILES)
    data = torch.frombuffer(bytearray(train_text), dtype=torch.uint8).long()
    held = torch.frombuffer(bytearray(held_text), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(args.seed + 1)
    heldout = tuple(t.to(device) for t in windows(held, torch.randint(0, held.numel() - cfg["ctx"] - 1,
                                                                       (cfg["eval_tokens"],), generator=g), cfg["ctx"]))
    probe_batch = tuple(t.to(device) for t in windows(data, torch.randint(0, data.numel() - cfg["ctx"] - 1,
                                                                           (cfg["tokens"],), generator=g), cfg["ctx"]))
    torch.manual_seed(args.seed)
    base = CharMLP(cfg["ctx"], cfg["emb"], cfg["hidden"], cfg["layers"])
    n_params = sum(q.numel() for q in base.parameters())
    probe_steps = sorted({max(1, round(cfg["steps"] * (k + 1) / cfg["probes"])) - 1 for k in range(cfg["probes"])})

    print(f"mpfused {mpfused.__version__}, torch {torch.__version__}, device {device}"
          f"{'' if device.type == 'cuda' else f' ({os.cpu_count()} CPUs)'}")
    print(f"data: {len(train_text):,} bytes of stdlib source for training ({len(TRAIN_FILES)} modules), "
          f"{len(held_text):,} held-out bytes ({', '.join(HELDOUT_FILES)})")
    print(f"model: {cfg['ctx']} previous bytes -> embedding {cfg['emb']} -> {cfg['layers']} x (Linear {cfg['hidden']}, "
          f"LayerNorm, GELU) -> Linear 256; {n_params:,} parameters. AdamW lr {cfg['lr']} (warm-up, cosine), "
          f"{cfg['tokens']} next-byte predictions per step (mean loss), {cfg['steps']} steps, seed {args.seed}")

    runs = []
    for name, level, scale in RUNS:
        probe = None
        if name == "O2":
            probe = {"steps": probe_steps, "x": probe_batch[0], "y": probe_batch[1],
                     "ref_model": copy.deepcopy(base).to(device)}
        runs.append(train_run(name, level, scale, base, cfg, data, heldout, device, args.seed, probe,
                              progress=not args.no_progress))
    print(f"linears in O1/O2/O3: {runs[1]['linear']}")

    summary = summarize(runs, cfg)
    res = {
        "device": str(device), "torch_version": torch.__version__, "mpfused_version": mpfused.__version__,
        "cpu_count": os.cpu_count(), "loadavg_1min_at_start": load_start,
        "loadavg_1min_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "seed": args.seed, "quick": args.quick, "config": cfg, "parameters": n_params,
        "data": {"train_files": TRAIN_FILES, "train_bytes": len(train_text), "heldout_files": HELDOUT_FILES,
                 "heldout_bytes": len(held_text)},
        "fp16_limits": {"log2_min_subnormal": LOG2_MIN_SUBNORMAL, "log2_min_normal": LOG2_MIN_NORMAL,
                        "max": FP16.max, "lost_update_ratio": LOST_RATIO},
        "table_fields": TABLE_FIELDS, "runs": runs, "summary": summary,
    }
    res["verdicts"] = verdicts(summary, runs)
    res["fixed_point"] = fixed_point_panel(args.quick, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print()
    print_table(runs)
    print_effects(res)
    if res["fixed_point"] is not None:
        print("4. Fixed point (Gupta et al. 2015), examples/fixed_point_gupta.py:", end="")
        fixed_point_gupta.print_table(res["fixed_point"])
    png = out / "demo.png"
    res["figure"] = str(png) if write_figure(res, png) else None
    res["seconds_total"] = time.perf_counter() - t_start
    json_path = out / "demo.json"
    res["json"] = str(json_path)
    json_path.write_text(json.dumps(_json_safe(res), indent=1, allow_nan=False))
    if device.type == "cpu" and load_start is not None:
        print(f"\nms/step are wall times on {os.cpu_count()} CPUs; 1-min load average {load_start:.1f} at the start, "
              f"{res['loadavg_1min_at_end']:.1f} at the end (other processes slow these timings down).")
    print(f"\nwritten to {out}/: demo.json{', demo.png' if res['figure'] else ' (no matplotlib: no figure)'}  "
          f"({res['seconds_total']:.1f} s)")
    return res


if __name__ == "__main__":
    main()
