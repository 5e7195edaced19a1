"""The project's performance goals: one table for every benchmark script.

Each row is one goal that a script marks PASS/FAIL from the numbers it measures in the run: the script
(``"optim"`` for bench_optim.py), the label its docstring, tables and JSON use (``"(a)"``), what it
compares (printed after the label), the comparison and threshold, the device it is decided on (on the
other device the script shows it as INFO or N/A), and why the threshold is what it is. The scripts read
their goals from here (:func:`goal`) and keep no thresholds of their own, so a goal changes in one place.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch

Number = Union[int, float]
_OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq}


@dataclass(frozen=True)
class Goal:
    """One row of the table. ``threshold`` in :meth:`text` and :meth:`met`: the one the run computed, for a
    row whose threshold is None."""

    script: str
    label: str
    what: str
    op: str
    threshold: Optional[Number]  # None: the script computes it in the run (see the reason)
    fmt: str  # how the threshold prints, unit included
    device: str  # "cpu", "cuda" or "any"
    reason: str
    scope: str = ""  # printed after the threshold, in parentheses
    dtype: Optional[str] = None  # the one dtype the goal is decided for (None: every dtype measured)
    at: Optional[int] = None  # the problem size it is decided at, where the script measures several

    @property
    def title(self) -> str:
        return f"{self.label} {self.what}"

    def text(self, threshold: Optional[Number] = None) -> str:
        """The threshold as the tables and the JSON show it, e.g. ``>= 1.25x (CPU)``."""
        shown = f"{self.op} {self.fmt.format(self.threshold if threshold is None else threshold)}"
        return f"{shown} ({self.scope})" if self.scope else shown

    def met(self, value: Optional[Number], threshold: Optional[Number] = None) -> bool:
        """Whether a measured value reaches the goal (never when nothing was measured)."""
        return value is not None and _OPS[self.op](value, self.threshold if threshold is None else threshold)

    def applies(self, device: torch.device, dtype: Optional[str] = None) -> bool:
        """Whether the goal is decided for a run on ``device`` (and for ``dtype``, where it names one)."""
        return self.device in ("any", device.type) and (self.dtype is None or dtype == self.dtype)


# Columns: script, label, what, op, threshold, fmt, device, reason (then scope, dtype, at where they apply).
GOALS: tuple[Goal, ...] = (
    # ---- bench_overflow.py: mpfused.non_finite_check_ ----------------------------------------------------
    Goal("overflow", "(a)", "our check, % of read roof", ">=", 85.0, "{:.0f}%", "cpu",
         "the check reads the list once and writes nothing: it should run at the memory's read speed, less "
         "the noise of a roof measured on a shared machine", scope="CPU"),
    Goal("overflow", "(b)", "check+sumsq speedup vs torch check -> _foreach_norm", ">=", 2.0, "{:.0f}x", "any",
         "ours reads the list once; torch's check reads and writes it (even at inv_scale 1), then "
         "_foreach_norm reads it again"),
    Goal("overflow", "(c)", "our check, kernel launches per call", "==", None, "{}", "cuda",
         "one launch per list up to a launch's capacity: the count the launch planner "
         "(core/multi_tensor_plan.h) gives for the list", scope="planned for this list"),
    Goal("overflow", "(d)", "check+unscale speed vs torch _amp_foreach_..._unscale_", ">=", 1.0, "{:.1f}x", "cpu",
         "the same job and traffic as torch's op (read and write once): FP16, widened through F16C blocks, "
         "must not be slower than torch", scope="CPU, FP16", dtype="FP16"),
    Goal("overflow", "(e)", "check+sumsq, % of read roof", ">=", 85.0, "{:.0f}%", "cpu",
         "FP16 halves the bytes per element: the widening and the sum must keep up with memory as the check "
         "alone does in (a)", scope="CPU, FP16", dtype="FP16"),
    # ---- bench_optim.py: one step() of FusedAdamW / FusedAdam / FusedSGD ----------------------------------
    Goal("optim", "(a)", "FP32 AdamW: ours vs torch fused AdamW", ">=", 1.0, "{:.1f}x", "cpu",
         "both are one pass at the memory roof (28 B/param): ours must be no slower than torch's fused CPU "
         "AdamW", scope="CPU"),
    Goal("optim", "(b)", "O2 AdamW: ours (check + step) vs torch's O2 pipeline", ">=", 1.25, "{:.2f}x", "cpu",
         "torch's pipeline moves about 44 B/param where ours moves 32 (bench_optim's traffic models): 1.375x, "
         "less a margin for the CPU's FP16/BF16 conversions", scope="CPU"),
    Goal("optim", "(c)", "ours, % of copy roof on the traffic model", ">=", 90.0, "{:.0f}%", "cuda",
         "an optimizer step streams every tensor once with no reuse: on a GPU it is bound by memory "
         "bandwidth alone", scope="CUDA"),
    Goal("optim", "(d)", "O2 AdamW: ours (check + step) vs torch's O2 pipeline", ">=", 1.5, "{:.1f}x", "cuda",
         "44 against 32 B/param, and torch's four multi-tensor ops per step against our two launches",
         scope="CUDA"),
    Goal("optim", "(e)", "O2 AdamW: ours (check + step) vs apex", ">=", 1.2, "{:.1f}x", "cuda",
         "apex's FusedAdam(master_weights) is the fused O2 optimizer users have now: ours must be clearly "
         "faster to be worth switching to", scope="CUDA, if apex"),
    Goal("optim", "(f)", "kernels launched by one step() per param group (1 group)", "<=", 1, "{}", "cuda",
         "step() always passes a step counter and the last block of the update increments it: a CUDA step "
         "is one launch per param group", scope="CUDA"),
    Goal("optim", "(g)", "FP32 LAMB: ours vs torch for-loop LAMB", ">=", 2.0, "{:.1f}x", "any",
         "ours moves 44 B/param in three passes (grad norm, moments, update); the loop's temporaries (clipped "
         "grad, the update and its norms) move well over twice that"),
    Goal("optim", "(h)", "FP32 Lion: ours vs torch foreach Lion", ">=", 2.0, "{:.1f}x", "any",
         "ours moves 20 B/param in one pass; the seven foreach ops read and write about 68"),
    Goal("optim", "(i)", "stochastic-rounding step time / round-to-nearest step time (no masters)", "<=", 1.10,
         "{:.3f}", "cpu",
         "the same 22 B/param of traffic; stochastic rounding adds a Philox4x32-10 block per eight elements "
         "(vectorised, philox_blocks.inc), which must hide behind the memory traffic to within 10%", scope="CPU"),
    Goal("optim", "(j)", "host overhead: FusedAdamW.step() vs torch fused AdamW (one-element tensors)", ">=", 1.0,
         "{:.2f}x", "any",
         "on a small model a step is host time: torch's fused AdamW is one generated binding and one kernel; "
         "ours must cost no more, per step (one tensor, with a fixed lr or a scheduler's new one each step) "
         "and per tensor (300 tensors)"),
    Goal("optim", "(k)", "FP32 AdamW: ours vs DeepSpeed's CPU Adam (when DeepSpeed is installed)", ">=", 1.0,
         "{:.2f}x", "cpu",
         "DeepSpeedCPUAdam is the CPU optimizer of ZeRO-Offload, vectorised C++ with OpenMP over the same 28 "
         "B/param: on its own ground, the host, ours must be at least as fast"),
    Goal("optim", "(l)", "FP16/BF16 AdamW without masters, nearest: ours vs DeepSpeed's CPU Adam on the same "
         "params (when installed)", ">=", 1.0, "{:.2f}x", "cpu",
         "DeepSpeedCPUAdam also updates 16-bit params in place with FP32 moments: the same 22 B/param job"),
    Goal("optim", "(m)", "BF16 AdamW with stochastic rounding, no masters: ours vs torchao's (when installed)",
         ">=", 1.0, "{:.2f}x", "cuda",
         "torchao's AdamW with bf16_stochastic_round does the same job (FP32 moments, 22 B/param) with one "
         "compiled Triton kernel per param on the GPU, its ground (on the CPU, an inductor C++ kernel call per "
         "param: INFO); ours does it in one pass over every param, so it must be at least as fast"),
    # ---- bench_scaler.py: GradScaler + FusedAdamW iteration with clipping ---------------------------------
    Goal("scaler", "(a)", "ours vs torch O2 iteration (FP32 masters, clip)", ">=", 1.5, "{:.1f}x", "any",
         "torch's O2 iteration moves 60 B/param where ours moves 36 (bench_scaler's traffic models): 1.67x, "
         "less a margin"),
    Goal("scaler", "(b)", "ours: host syncs per iteration", "==", 0, "{}", "cuda",
         "found_inf, the clip coefficient and the scale stay on the device: a sync would stall the host's "
         "launch queue every iteration", scope="CUDA"),
    Goal("scaler", "(c)", "ours: kernel launches per param group per iteration", "<=", 3, "{}", "cuda",
         "one clip pass (inf check + sum of squares), one fused update, one scale update", scope="CUDA"),
    # ---- bench_random.py: mpfused.round_stochastic ------------------------------------------------------
    Goal("random", "(a)", "round_stochastic, % of copy roof", ">=", 85.0, "{:.0f}%", "any",
         "one pass that reads 4 and writes 2 bytes per element: it should run at the memory's copy speed, as "
         "the round-to-nearest conversion does, less the noise of a roof measured on a shared machine; the "
         "random bits must not be the bottleneck (the run prints the generator's own ceiling beside it)"),
    Goal("random", "(b)", "round_stochastic vs torch randint + add + shift (BF16)", ">=", 2.0, "{:.1f}x", "any",
         "torch's composite writes and reads an int32 tensor of random numbers and makes two more passes (add, "
         "shift and narrow): about 3x our traffic", dtype="BF16"),
    # ---- bench_fixed_point.py: mpfused.fixed_point Convert ------------------------------------------------
    Goal("fixed_point", "(a)", "quantize nearest into out=, % of y.copy_(x) of the same bytes", ">=", 85.0,
         "{:.0f}%", "cpu",
         "Convert reads 4 B and writes 4 B per element, as a copy between preallocated buffers does (the "
         "memory's copy roof, as for round_stochastic); the rounding must keep up with memory, less the noise "
         "of a shared machine. The allocating call adds the first touch of its output's pages, which is the "
         "allocator's and the OS's cost, not the kernel's: the run shows it beside x.clone() (INFO)", scope="CPU"),
    Goal("fixed_point", "(b)", "quantize stochastic into out=, % of y.copy_(x) of the same bytes", ">=", 85.0,
         "{:.0f}%", "cpu",
         "the same traffic as (a): the Philox words are computed in vectorised blocks that stay in L1, never "
         "read from memory", scope="CPU"),
    # ---- bench_dist.py: FusedAdamW.step() on many small DTensor params (FSDP2, gloo, CPU) -----------------
    Goal("dist", "(a)", "FusedAdamW step() on small DTensor params: time / torch fused AdamW's", "<=", 1.0,
         "{:.2f}", "cpu",
         "with hundreds of small FSDP2 params a step is host time: torch's fused AdamW pays DTensor dispatch "
         "on its one fused op over every param; ours reads the local shards directly and runs one kernel per "
         "group, so its per-param Python checks must cost no more than torch's dispatch", scope="CPU, gloo, rank 0"),
    # ---- bench_gemm.py: mpfused.gemm and FusedLinear -------------------------------------------------------
    Goal("gemm", "(a)", "ours vs torch's FP16 matmul (CPU)", ">=", 20.0, "{:.0f}x", "cpu",
         "torch's FP16 CPU GEMM is a slow fallback (about 0.4 to 2.4 GFLOP/s) that exact widening plus "
         "ATen's FP32 GEMM must leave far behind", at=2048),
    Goal("gemm", "(b)", "ours vs torch's FP32 matmul (CPU)", ">=", 0.7, "{:.1f}x", "cpu",
         "ours is ATen's FP32 GEMM plus the widening and our epilogue: those passes may cost at most ~30%",
         at=2048),
    Goal("gemm", "(c)", "ours vs cuBLAS (torch.matmul), throughput ratio (CUDA)", ">=", 0.5, "{:.2f}x", "cuda",
         "a WMMA kernel without cuBLAS's per-arch tuning: half of cuBLAS's FP16 throughput on an H100",
         at=4096),
    Goal("gemm", "(d)", "fused bias+GELU vs torch's linear + gelu (CUDA)", ">=", 1.0, "{:.1f}x", "cuda",
         "the fused epilogue saves writing and reading the output once more: at K <= 1024 that traffic is a "
         "large share of the time, so fusing must never be slower (outputs 4096x4096 and up)"),
)


def goal(script: str, label: str) -> Goal:
    """The row of ``script``'s goal ``label``, e.g. ``goal("optim", "(a)")``."""
    found = [g for g in GOALS if g.script == script and g.label == label]
    if len(found) != 1:
        raise KeyError(f"{len(found)} goals {script} {label} in benchmarks/goals.py (expected one)")
    return found[0]
