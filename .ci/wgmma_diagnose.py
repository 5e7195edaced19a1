"""Where the Hopper GEMM kernel goes wrong, when its tests fail on a GPU (the GPU check's tests stage runs this
then), or by hand:

    python .ci/wgmma_diagnose.py [--device cuda|cpu] [--kernel wgmma|wgmma-cluster] [--case NAME]

Each case multiplies operands whose products name their sources, so that a wrong output says where it came from.
A selects one K index per output row: A[b, i, k] = 1 where k == (i + 7 b) % K, else 0; so out[b, i, j] is
B[b, (i + 7 b) % K, j] exactly. B holds either its K index (B[b, k, j] = k + 1 + 512 b) or its column
(B[b, k, j] = j % 512 + 1 + 512 b), every value exact in FP16 and BF16. A wrong output is decoded back into
the batch and the K index (or column) it came from, and the wrong outputs are counted by their place in the
kernel's 128 x 256 tile: the CTA of a cluster's pair of tiles (128 rows each), the consumer warpgroup (64 rows
each), its warp (16 rows), the group of 32 columns that
a warp's epilogue slice holds, and the column within 8 (a 16-byte chunk of the output).

Cases: every layout of A and B (row- or column-major), K = 64 (one stage) and 320 (5 stages over the ring of 4),
3 batches of 384 x 768 (27 work items of 128 x 256 over the SMs of a persistent grid), FP32 outputs; for the Hopper
kernel alone and in clusters of two CTAs (MPFUSED_GEMM_KERNEL=wgmma, wgmma-cluster; both unless --kernel). A case that
raises (a trap loses the process's CUDA context) leaves the rest to a new process. `--device cpu` runs the same
checks on the CPU GEMM (a check of this script). Exit status: 0 when every case passed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH, M, N = 3, 384, 768
KERNELS = ["wgmma", "wgmma-cluster"]
CASES = [f"{dt}-a{'col' if ac else 'row'}-b{'col' if bc else 'row'}-k{k}-{src}"
         for dt in ("fp16", "bf16") for ac in (False, True) for bc in (False, True) for k in (64, 320)
         for src in ("krow", "col") if dt == "fp16" or (k == 320 and src == "krow")]


def run_case(name: str, device: str, kernel: str = "wgmma") -> tuple[bool, str]:
    import torch

    sys.path.insert(0, str(ROOT))
    import mpfused
    from mpfused import _ops

    dt_name, a_lay, b_lay, k_name, src = name.split("-")
    dtype = torch.float16 if dt_name == "fp16" else torch.bfloat16
    a_col, b_col, k = a_lay == "acol", b_lay == "bcol", int(k_name[1:])
    dev = torch.device(device)
    os.environ["MPFUSED_GEMM_KERNEL"] = kernel  # read by the extension at each call
    if dev.type == "cuda":
        chosen = _ops._C.gemm_cuda_kernel(dev.index or 0)
        if chosen != kernel:
            return False, f"the {kernel} kernel is not selected here (gemm_cuda_kernel: {chosen!r})"
    bi = torch.arange(BATCH).view(BATCH, 1, 1)
    rows = torch.arange(M).view(1, M, 1)
    ks = torch.arange(k).view(1, 1, k)
    a = ((rows + 7 * bi) % k == ks).to(dtype)  # (B, M, K)
    kk = torch.arange(k).view(1, k, 1)
    cols = torch.arange(N).view(1, 1, N)
    code = (kk + 0 * cols) if src == "krow" else (cols % 512 + 0 * kk)
    b = (code + 1 + 512 * bi).to(dtype)  # (B, K, N)
    expected = b.float().gather(1, ((torch.arange(M).view(1, M, 1) + 7 * bi) % k).expand(BATCH, M, N))
    # the layouts: a column-major operand is the transpose of a contiguous one
    a_dev = a.transpose(1, 2).contiguous().to(dev).transpose(1, 2) if a_col else a.to(dev)
    b_dev = b.transpose(1, 2).contiguous().to(dev).transpose(1, 2) if b_col else b.to(dev)
    try:
        out = mpfused.gemm(a_dev, b_dev, out_dtype=torch.float32)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as e:  # a trap or a refused launch: the message is the finding
        return False, f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    out = out.cpu()
    wrong = (out != expected).nonzero().tolist()
    if not wrong:
        return True, "ok"
    by = {"cta of a pair": Counter(), "consumer": Counter(), "warp": Counter(), "cols32": Counter(), "col%8": Counter(),
          "batch": Counter()}
    for bb, i, j in wrong:
        by["cta of a pair"][i % 256 // 128] += 1
        by["consumer"][i % 128 // 64] += 1
        by["warp"][i % 64 // 16] += 1
        by["cols32"][j % 256 // 32] += 1
        by["col%8"][j % 8] += 1
        by["batch"][bb] += 1
    parts = [f"{len(wrong)} of {out.numel()} wrong"]
    parts += [f"by {key} {dict(sorted(c.items()))}" for key, c in by.items()]
    first = []
    for bb, i, j in wrong[:6]:
        v = out[bb, i, j].item()
        if v == int(v) and v >= 1:
            ob, oc = divmod(int(v) - 1, 512)
            what = f"from batch {ob} {'k' if src == 'krow' else 'col%512'} {oc}"
        else:
            what = "not a value of B"
        want = (i + 7 * bb) % k if src == "krow" else j % 512
        first.append(f"({bb},{i},{j}) got {v:g} ({what}), want batch {bb} {'k' if src == 'krow' else 'col%512'} {want}")
    return False, "; ".join(parts) + "; first: " + " | ".join(first)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--kernel", choices=KERNELS, help="one of the Hopper kernel's forms (default: both)")
    parser.add_argument("--case", choices=CASES, help="one case only")
    parser.add_argument("--start", type=int, default=0, help="the runs from this index on (after a lost context)")
    args = parser.parse_args()
    kernels = [args.kernel] if args.kernel else KERNELS
    runs = [(k, c) for k in kernels for c in ([args.case] if args.case else CASES)][args.start:]
    failed = 0
    for n, (kernel, name) in enumerate(runs):
        ok, msg = run_case(name, args.device, kernel)
        print(f"{kernel} {name}: {msg}", flush=True)
        failed += not ok
        if not ok and msg.startswith("raised") and args.device == "cuda" and n + 1 < len(runs):
            # the CUDA context may be lost (a trap is sticky): the rest in a new process
            rest = [sys.executable, __file__, "--device", args.device, "--start", str(args.start + n + 1)]
            rest += (["--kernel", args.kernel] if args.kernel else []) + (["--case", args.case] if args.case else [])
            r = subprocess.run(rest, timeout=600)
            return 1 if r.returncode or failed else 0
    print(f"wgmma diagnosis: {len(runs) - failed} of {len(runs)} runs passed (from run {args.start})", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
