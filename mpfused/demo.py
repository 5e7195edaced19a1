"""`python -m mpfused.demo`: the multi-tensor overflow reduction on a real model's gradients.

A small character-level LSTM language model is trained (FP32, AdamW, a few dozen steps) on the source
code of a few Python standard-library modules, encoded as bytes, so nothing is downloaded. Then, on one
held-out batch, the gradients of ``S * loss`` are computed for a sweep of loss scales S, cast to FP16
and to BF16 (as a half-precision model's gradients would be stored), and ONE call of
``mpfused.non_finite_check_`` over the whole gradient list, with ``inv_scale = 1/S`` and ``sumsq``,
reports whether anything overflowed and the unscaled global gradient norm. The table shows why loss
scaling exists: at S = 1 part of the FP16 gradient flushes to zero (underflow); a larger S lifts it into
FP16's range, until a too large S overflows (found_inf = 1) and the step would be skipped. BF16 has
FP32's exponent range: it neither underflows nor overflows here, at the price of 8 bits of precision.

Finally the single fused call is timed against torch's own pair,
``torch._amp_foreach_non_finite_check_and_unscale_`` + ``torch._foreach_norm``, on the same list.
Everything printed is also written to ``<out>/overflow_demo.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sysconfig
import time
from pathlib import Path

import torch

import mpfused

# Standard-library modules whose source is the training text: plain Python that ships with every
# CPython install (read from the stdlib directory; nothing is downloaded).
STDLIB_FILES = ["textwrap.py", "string.py", "difflib.py", "argparse.py", "functools.py",
                "dataclasses.py", "typing.py", "enum.py", "calendar.py", "shutil.py"]
QUICK_FILES = ["textwrap.py", "string.py", "difflib.py"]
LOG2_SCALES = [0, 8, 16, 24, 32, 40]
LR = 3e-3

# FP16: largest finite 65504 (|x| >= 65520 rounds to inf); smallest normal 2^-14; smallest subnormal
# 2^-24, so |x| <= 2^-25 rounds to zero. BF16 keeps FP32's exponent range with an 8-bit significand.


# ---- data -------------------------------------------------------------------------------------------
def load_text(files) -> bytes:
    """Concatenated source of standard-library modules, as bytes. Falls back to the source of modules
    found through ``inspect`` if the stdlib directory has no .py files (some distributions strip them)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in files:
        path = stdlib / name
        if path.is_file():
            parts.append(path.read_bytes())
    if not parts:
        import inspect
        import textwrap, string, difflib, argparse as _argparse  # noqa: E401 (only their source is used)
        for mod in (textwrap, string, difflib, _argparse):
            try:
                parts.append(inspect.getsource(mod).encode("utf-8"))
            except (OSError, TypeError):
                pass
    if not parts:
        raise RuntimeError(f"no standard-library source found under {stdlib}")
    return b"\n".join(parts)


def batch(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator):
    """Random windows of ``seq_len + 1`` bytes: inputs and next-byte targets."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    windows = data[idx]
    return windows[:, :-1], windows[:, 1:]


# ---- model ------------------------------------------------------------------------------------------
class CharLSTM(torch.nn.Module):
    def __init__(self, emb: int, hidden: int, layers: int = 2, vocab: int = 256):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, emb)
        self.lstm = torch.nn.LSTM(emb, hidden, num_layers=layers, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, x):
        h, _ = self.lstm(self.embed(x))
        return self.head(h)


def lm_loss(model, x, y):
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def grads_of(model, loss_fn, scale: float):
    """FP32 gradients of ``scale * loss``, one contiguous tensor per parameter (in parameter order)."""
    model.zero_grad(set_to_none=True)
    (loss_fn() * scale).backward()
    return [p.grad.detach().clone().contiguous() for p in model.parameters() if p.grad is not None]


# ---- measurements -----------------------------------------------------------------------------------
def fused_check(grads, inv_scale: float, device):
    """ONE call of the overflow reduction over the whole list: (found_inf, unscaled global norm)."""
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    sumsq = torch.zeros(1, dtype=torch.float32, device=device)
    inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
    mpfused.non_finite_check_(grads, found_inf, inv, sumsq=sumsq)
    return float(found_inf.item()), math.sqrt(float(sumsq.item()))


def ref_norm(grads32, inv_scale: float) -> float:
    """FP64 reference: global L2 norm of the FP32 gradients times inv_scale."""
    return math.sqrt(sum(float((g.double() * inv_scale).square().sum()) for g in grads32))


def underflow_stats(grads32, grads_low):
    """Among elements that are nonzero in FP32: how many flush to zero in the low-precision copy, and
    how many land in its subnormal range (nonzero but below the smallest normal: precision lost)."""
    tiny = torch.finfo(grads_low[0].dtype).tiny
    nonzero = flushed = subnormal = 0
    for g32, g in zip(grads32, grads_low):
        nz = g32 != 0
        nonzero += int(nz.sum())
        flushed += int((nz & (g == 0)).sum())
        subnormal += int(((g != 0) & (g.float().abs() < tiny)).sum())
    return nonzero, flushed, subnormal


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(grads, inv_scale: float, device, repeats: int):
    """Median wall time of (a) our single call (unscale in place + sumsq) and (b) torch's pair
    ``_amp_foreach_non_finite_check_and_unscale_`` + ``_foreach_norm`` (+ the norm of the per-tensor
    norms, as ``get_total_norm`` does), on fresh copies of the same list each repeat (both unscale in
    place, so a copy is taken outside the timed region)."""
    inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)

    def ours(ts):
        found = torch.zeros(1, dtype=torch.float32, device=device)
        sumsq = torch.zeros(1, dtype=torch.float32, device=device)
        mpfused.non_finite_check_(ts, found, inv, unscale=True, sumsq=sumsq)
        return found, sumsq.sqrt()

    def theirs(ts):
        found = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(ts, found, inv)
        norms = torch._foreach_norm(ts, 2, dtype=torch.float32)
        return found, torch.linalg.vector_norm(torch.stack(norms))

    results = {}
    for name, fn in (("mpfused", ours), ("torch", theirs)):
        times = []
        for i in range(repeats + 1):  # the first run is a warm-up
            ts = [g.clone() for g in grads]
            _sync(device)
            t0 = time.perf_counter()
            found, norm = fn(ts)
            _sync(device)
            if i:
                times.append(time.perf_counter() - t0)
        results[name] = {"median_us": statistics.median(times) * 1e6, "min_us": min(times) * 1e6,
                         "repeats": repeats, "found_inf": float(found.item()), "norm": float(norm.item())}
    return results


# ---- output -----------------------------------------------------------------------------------------
def print_report(res):
    info = res["build_info"]
    print(f"mpfused {info['version']} (built against torch {info['torch_version']}, CUDA "
          f"{info['cuda_version']}, arch {info['cuda_arch_list']}, OpenMP {info['openmp']}); "
          f"torch {res['torch_version']} running; device: {res['device']}")
    m, tr = res["model"], res["training"]
    print(f"data: {res['data']['bytes']:,} bytes of Python stdlib source ({', '.join(res['data']['files'])})")
    print(f"model: {m['description']}, {m['parameters']:,} parameters in {m['tensors']} tensors, FP32, "
          f"seed {res['seed']}")
    if tr["steps"]:
        print(f"trained {tr['steps']} AdamW steps (batch {m['batch']} x {m['seq_len']} bytes) in "
              f"{tr['seconds']:.1f} s: loss {tr['loss_first']:.3f} -> {tr['loss_last']:.3f}; held-out batch "
              f"{tr['eval_loss']:.3f} (uniform guess: ln 256 = {math.log(256):.3f})")
    print()
    print("Gradients of S*loss on one held-out batch, cast to FP16/BF16, then ONE mpfused.non_finite_check_"
          " call over the whole list (inv_scale=1/S, sumsq).\nFP16 flushes small gradients to zero at S=1; "
          "a larger S saves them until it overflows (found_inf=1: the step is skipped). BF16 needs no scaling.")

    headers = ["dtype", "S", "found_inf", "max |S*g| FP32", "norm (mpfused)", "FP32 ref norm", "rel err",
               "flushed to 0", "subnormal"]
    rows = []
    for r in res["sweep"]:
        rows.append([r["dtype"], f"2^{r['log2_scale']}", f"{r['found_inf']:g}", f"{r['max_abs_scaled_fp32']:.3g}",
                     "inf" if r["norm"] is None else f"{r['norm']:.7g}", f"{r['ref_norm']:.7g}",
                     "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}",
                     f"{100 * r['flushed_frac']:.3f}%", f"{100 * r['subnormal_frac']:.2f}%"])
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        for row in rows:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    else:
        console = Console()
        if not console.is_terminal:  # piped / captured: do not squeeze the table into 80 columns
            console = Console(width=max(console.width, 132))
        table = Table(*headers)
        for i, row in enumerate(rows):
            if i and row[0] != rows[i - 1][0]:
                table.add_section()
            table.add_row(*row, style="red" if row[2] != "0" else None)
        console.print(table)
    print("ref = FP64 norm of the FP32 gradients of the unscaled loss; rel err = |norm - ref| / ref. "
          "Fractions: of the elements nonzero in FP32.\n'subnormal': nonzero but below the dtype's smallest "
          "normal number, so stored with fewer significant bits.")
    print()
    t = res["timing"]
    tm, tt = t["mpfused"], t["torch"]
    print(f"Timing on the FP16 list at S=2^{t['log2_scale']} ({t['elements']:,} elements in {t['tensors']} "
          f"tensors, {res['device']}), median of {tm['repeats']} runs (min in brackets)"
          + ("" if t["loadavg_1min"] is None else
             f"; 1-min load average {t['loadavg_1min']:.1f} on {t['cpu_count']} CPUs, this process included")
          + ":")
    print(f"  mpfused.non_finite_check_(unscale=True, sumsq), 1 call          {tm['median_us']:9.1f} us "
          f"({tm['min_us']:.1f})  norm rel err {tm['rel_err']:.1e}")
    print(f"  torch._amp_foreach_non_finite_check_and_unscale_ + _foreach_norm {tt['median_us']:9.1f} us "
          f"({tt['min_us']:.1f})  norm rel err {tt['rel_err']:.1e}")
    print(f"  torch / mpfused: {tt['median_us'] / tm['median_us']:.2f}x")
    print(f"\nwritten: {res['json_path']}  (demo body {res['seconds_total']:.1f} s)")


# ---- main -------------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mpfused.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="AdamW training steps (default 40; 30 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model, 30 steps (for tests; about a second on 2 idle CPU cores)")
    p.add_argument("--out", default="demo_out", help="directory for overflow_demo.json")
    p.add_argument("--repeats", type=int, default=None, help="timing repeats (default 30; 5 with --quick)")
    args = p.parse_args(argv)

    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and mpfused.has_cuda_kernels() else "cpu")
    if args.quick:
        cfg = dict(files=QUICK_FILES, emb=16, hidden=48, batch=16, seq=32, steps=30, repeats=5)
    else:
        cfg = dict(files=STDLIB_FILES, emb=64, hidden=256, batch=32, seq=64, steps=40, repeats=30)
    steps = cfg["steps"] if args.steps is None else args.steps
    repeats = cfg["repeats"] if args.repeats is None else args.repeats

    torch.manual_seed(args.seed)
    text = load_text(cfg["files"])
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(args.seed)

    model = CharLSTM(cfg["emb"], cfg["hidden"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = (t.to(device) for t in batch(data, cfg["batch"], cfg["seq"], gen))
        loss = lm_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    train_s = time.perf_counter() - t0

    # One held-out batch (its own generator) for the sweep.
    x, y = (t.to(device) for t in batch(data, cfg["batch"], cfg["seq"],
                                         torch.Generator().manual_seed(args.seed + 1_000_003)))
    with torch.no_grad():
        eval_loss = float(lm_loss(model, x, y))
    loss_fn = lambda: lm_loss(model, x, y)  # noqa: E731
    scaled = {k: grads_of(model, loss_fn, 2.0 ** k) for k in LOG2_SCALES}  # FP32 gradients of S*loss
    grads1 = grads_of(model, loss_fn, 1.0)
    ref = ref_norm(grads1, 1.0)  # the target: FP64 norm of the FP32 gradients of the unscaled loss

    sweep = []
    for dtype in (torch.float16, torch.bfloat16):
        for k, grads32 in scaled.items():
            scale = 2.0 ** k
            low = [g.to(dtype) for g in grads32]
            found, norm = fused_check(low, 1.0 / scale, device)
            nonzero, flushed, subnormal = underflow_stats(grads32, low)
            finite = math.isfinite(norm)
            sweep.append({
                "dtype": str(dtype).replace("torch.", ""),
                "log2_scale": k,
                "scale": scale,
                "found_inf": found,
                "norm": norm if finite else None,
                "ref_norm": ref,
                "ref_norm_scaled_grads": ref_norm(grads32, 1.0 / scale),
                "rel_err": abs(norm - ref) / ref if finite else None,
                "nonzero_fp32": nonzero,
                "flushed": flushed,
                "flushed_frac": flushed / nonzero,
                "subnormal": subnormal,
                "subnormal_frac": subnormal / nonzero,
                "max_abs_scaled_fp32": max(float(g.abs().max()) for g in grads32),
            })

    # Time on the FP16 list at the largest scale that did not overflow: where a dynamic loss scaler
    # would settle, and the common case (no inf/NaN) that both implementations must scan completely.
    ok = [r["log2_scale"] for r in sweep if r["dtype"] == "float16" and r["found_inf"] == 0]
    timing_k = max(ok) if ok else LOG2_SCALES[0]
    timing_grads = [g.to(torch.float16) for g in scaled[timing_k]]
    timing = time_calls(timing_grads, 2.0 ** -timing_k, device, repeats)
    for name in ("mpfused", "torch"):
        timing[name]["rel_err"] = abs(timing[name]["norm"] - ref) / ref
    timing.update(log2_scale=timing_k, tensors=len(timing_grads),
                  elements=sum(g.numel() for g in timing_grads), cpu_count=os.cpu_count(),
                  # Other processes on the machine inflate CPU timings: recorded, so they can be judged.
                  loadavg_1min=os.getloadavg()[0] if hasattr(os, "getloadavg") else None)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "overflow_demo.json"
    res = {
        "device": str(device),
        "build_info": mpfused.build_info(),
        "torch_version": torch.__version__,
        "seed": args.seed,
        "quick": args.quick,
        "data": {"files": cfg["files"], "bytes": len(text)},
        "model": {"description": f"byte embedding {cfg['emb']} + 2-layer LSTM {cfg['hidden']} + linear head",
                  "parameters": sum(p.numel() for p in model.parameters()),
                  "tensors": len(grads1), "batch": cfg["batch"], "seq_len": cfg["seq"]},
        "training": {"steps": steps, "seconds": train_s, "lr": LR, "losses": losses,
                     "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
                     "eval_loss": eval_loss},
        "sweep": sweep,
        "timing": timing,
        "notes": "norm/rel_err are null where the unscaled sum of squares is not finite (overflow). "
                 "ref_norm: FP64 norm of the FP32 gradients of the unscaled loss; ref_norm_scaled_grads: "
                 "FP64 norm of the FP32 gradients of S*loss times 1/S.",
        "json_path": str(json_path),
    }
    res["seconds_total"] = time.perf_counter() - t_start
    json_path.write_text(json.dumps(res, indent=2, allow_nan=False))
    print_report(res)
    return res


if __name__ == "__main__":
    main()
