"""Benchmark of one step of the fused optimizers: ``FusedAdamW``, ``FusedAdam``, ``FusedSGD``, ``FusedLAMB``, ``FusedLion``.

One ``step()`` is timed with the gradients already in place, on a param list shaped like a model's
(default: 300 tensors with the size spread of ``bench_overflow.model_like_sizes``, 50M params on the CPU
and 200M on CUDA; ``--params`` chooses the total, e.g. 50M, 200M or 1B where memory allows; ``--quick``:
2M). CUDA defaults to more params because at 50M a step takes the device about 0.5 ms, no longer than
``step()``'s host work for 300 tensors (see the host overhead table): the timings would measure Python
rather than the kernels. The CPU keeps 50M so that a default run takes about a minute on two cores.

Every section is timed in rounds (one call of each method per round, in a shuffled order) in one run,
interleaved with the harness's roof probe, so the methods and the roofs see the same machine state:

============== ============================================ ==================================================
section        mpfused                                      anchors (all in the same run)
============== ============================================ ==================================================
FP32 AdamW     ``FusedAdamW.step()``                        ``torch.optim.AdamW`` with foreach=False (for-loop),
                                                            foreach=True and fused=True; on the CPU, DeepSpeed's
                                                            ``DeepSpeedCPUAdam(adamw_mode=True)`` (ZeRO-Offload's
                                                            optimizer) when DeepSpeed is installed
FP32 Adam      ``FusedAdam.step()``                         ``torch.optim.Adam(fused=True)`` only (to keep the
                                                            run short; AdamW has the full set)
FP32 SGD       ``FusedSGD(momentum=0.9).step()``            ``torch.optim.SGD(momentum=0.9)``, the same three
FP32 LAMB      ``FusedLAMB(max_grad_norm=1,                 torch has no LAMB: a for-loop LAMB with apex's
               weight_decay=0.01).step()``                  semantics, written in this file (``TorchLamb``)
FP32 Lion      ``FusedLion(weight_decay=0.01).step()``      torch has no Lion: for-loop and ``torch._foreach_*``
                                                            Lion, written in this file (``TorchLion``)
O2 FP16/BF16   ``non_finite_check_(grads, found)`` then     torch's O2 pipeline: (a)
AdamW          ``FusedAdamW.step()`` with ``grad_scale`` =  ``_amp_foreach_non_finite_check_and_unscale_`` on
               S and ``found_inf`` set (the full job);      the FP16/BF16 grads, (b) ``_foreach_copy_`` into FP32
               ``step()`` alone as a second row             master grads, (c) ``torch.optim.AdamW(fused=True)``
                                                            on the masters, skipping on the device through its
                                                            ``found_inf`` (foreach + a host check of found_inf
                                                            where fused is unavailable), (d) ``_foreach_copy_``
                                                            of the masters into the FP16/BF16 params; apex
                                                            ``FusedAdam(master_weights=True, capturable=True)``
                                                            stepped with a GradScaler, when ``import apex`` works
host overhead  ``step()`` on 300 one-element tensors: FP32,  ``torch.optim.AdamW(fused=True)`` on the same; the
               FP16 O2, and FP16 without masters with       stochastic row against the nearest one (goal (i))
               ``rounding`` "nearest" and "stochastic"
overhead of    ``step()`` on one one-element FP32 tensor      ``torch.optim.AdamW(fused=True)`` on the same
one tensor     (overhead-1), and the same with a new lr
               object every step, as an lr scheduler sets
               it (overhead-1-lr)
SR FP16/BF16   ``FusedAdamW(master_weights=False,           the same step with ``rounding="nearest"`` (the
               rounding="stochastic").step()``, and the     anchor: what stochastic rounding costs); on the CPU,
               nearest one                                  DeepSpeed's CPU Adam on the same 16-bit params (FP32
                                                            moments, no masters: the nearest row's job), when
                                                            DeepSpeed is installed
remainder BF16 ``FusedAdamW(master_weights="remainder")``   ``FusedAdamW(master_weights=True)``: FP32 masters
sr-torchao     ``FusedAdamW(master_weights=False,           torchao's ``_AdamW(bf16_stochastic_round=True)``
               rounding="stochastic")`` on BF16 params,     (FP32 moments, BF16 params written with stochastic
               and the nearest one, on a transformer's      rounding; a torch.compile'd kernel per param), when
               shapes (few distinct ones: torchao           torchao is installed (else the section is skipped)
               compiles once per shape)
follow FP16    ``clamp_`` of every FP16 param, then         torch's O2 pipeline with the same clipping: fused
AdamW          ``FusedAdamW.step()`` (FP32 masters), whose  AdamW on FP32 masters, ``clamp_`` of the masters,
               masters follow the write (weight clipping;   ``_foreach_copy_`` into the FP16 params; and our
               an Embedding's max_norm writes alike)        step with no write between steps (what following
                                                            costs)
============== ============================================ ==================================================

The host-overhead sections time 50 consecutive steps per sample and report the time per step: the
steady state of a small model's training loop, whose caches hold the optimizer's code and state between
steps. (A single step right after the roof probe has emptied every cache costs several times more, for
torch's optimizer and ours alike, and varies more than the difference between them.)

A fused torch variant that raises is reported as "n/a" with the reason. Hyperparameters: lr 1e-3, betas
(0.9, 0.999), eps 1e-8, AdamW weight decay 1e-2, SGD momentum 0.9; one param group.

Why the O2 job includes ``non_finite_check_``: ``FusedAdamW.step()`` consumes ``found_inf`` (it skips the
step on the device when it is set) and unscales by 1/S in the kernel, but it does not look for inf/NaN
in the gradients itself; the check is a separate pass (GradScaler runs one before ``step()``). torch's
pipeline does the check in (a), so the fair comparison, and the one the targets use, is check + step.

Traffic models, in bytes per param (the effective GB/s = params x model bytes / median time, compared with
the harness's copy roof, measured interleaved with the section):

- FP32 AdamW / Adam: param read + write 8, grad read 4, exp_avg read + write 8, exp_avg_sq read + write 8 = 28.
- FP32 SGD with momentum: param 8, grad 4, momentum buffer 8 = 20.
- AdamW on FP16/BF16 params without masters (the SR sections): param read + write 4, grad read 2, moments
  16 = 22, for either rounding (stochastic rounding adds Philox arithmetic, no traffic).
- AdamW on BF16 params with remainders: param read + write 4, remainder read + write 4, grad 2, moments 16
  = 26; with FP32 masters: master read + write 8, param write 2, grad 2, moments 16 = 28.
- follow: our step with FP32 masters and no unscale 28, the clamp_ of the FP16 params (one clamp_ per
  tensor: read + write 4), and following it (param read 2, master read + write 8 where the clamp changed a
  block) = 42. torch's pipeline is charged the same, though it moves about 48 (grads to FP32 6, AdamW 28, the
  masters' clamp_ 8, the copy 6). A write between steps sends our step down its full path (per-param Python,
  a few microseconds a param): at 2M params (--quick) that host time outweighs the memory work and our row
  is the slower one; from about 50M params on the CPU the memory work dominates.
- AdamW O2: 30 (FP32 master read + write 8, FP16/BF16 grad read + write of the unscaled value 4, moments
  16, FP16/BF16 param write 2) plus 2 for the inf check (the grads read once more) = 32; ``step()`` alone:
  30. torch's pipeline is charged the same 32 B per param (the job), though it moves about 44 (a: 4, b: 6,
  c: 28, d: 6). A third row steps grads that need no unscale, so nothing is written back (28 B/param): the
  difference is the measured cost of leaving ``p.grad`` unscaled, as torch's fused optimizers do.

Every method takes one untimed step first (optimizer state is created lazily, in the first step), then
the harness's warm-up and timed steps. Timing repeated steps on the same tensors is fine: speed does not
depend on the values. The grads are small (N(0, 1e-3), times S for the O2 lists), and every list is
checked after the run: params and masters finite, found_inf still 0, and the step counts equal to the
calls made (so no step was skipped). torch's O2 pipeline unscales its grads in place; as in
bench_overflow, its calls alternate 1/S and S, so the grads alternate between two states instead of
draining to zero (or into the subnormal range).

The project's targets, marked PASS/FAIL from the numbers measured in the run (their thresholds and
reasons are rows of benchmarks/goals.py):
(a) CPU: our FP32 AdamW step against torch's fused CPU AdamW;
(b) CPU: our O2 AdamW (check + step) against torch's O2 pipeline;
(c) CUDA: our steps as a share of the copy roof on the traffic model;
(d) CUDA: our O2 AdamW against torch's O2 pipeline, and (e) against apex when apex is present;
(f) CUDA: the kernels one ``step()`` launches per param group (counted with torch.profiler);
(i) CPU: the step with stochastic rounding within 10% of the time of the same step rounding to nearest;
(k) CPU: our FP32 AdamW against DeepSpeed's CPU Adam, and (l) our nearest 16-bit step against it on the same
params (N/A where DeepSpeed is not installed: ``pip install deepspeed``; its CPU Adam builds on first use);
(m) CUDA: our stochastic-rounding BF16 step against torchao's (``pip install torchao``; INFO on the CPU, where
torchao runs one inductor C++ kernel call per param: not its ground).
The remainder mode's time against FP32 masters is reported as INFO.

Memory: each section's tensors are freed before the next one is built; a section that would not fit in
the memory available (host RAM on the CPU, free GPU memory on CUDA) is skipped with the estimate.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import mpfused
from mpfused.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedLion, FusedSGD

from .bench_overflow import model_like_sizes, torch_amp_unscale
from .goals import goal
from .harness import (
    GB,
    RoofProbe,
    Roofs,
    Timing,
    count_cuda_kernels,
    cpu_busy_fraction,
    json_path,
    machine_info,
    make_parser,
    measure_roofs,
    parse_args,
    positive_int,
    print_header,
    print_table,
    print_text,
    sizes_or_error,
    time_interleaved,
    warn_if_busy,
    write_json,
)

NAME = "optim"
SEED = 0
LOSS_SCALE = 65536.0
GRAD_STD = 1e-3
LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 1e-2  # AdamW; Adam and SGD keep torch's default 0
MOMENTUM = 0.9
DEFAULT_TENSORS = 300
DEFAULT_PARAMS = {"cpu": 50_000_000, "cuda": 200_000_000}
QUICK_PARAMS = 2_000_000
OVERHEAD_TENSORS = 300
OVERHEAD_BURST = 50  # steps per timed call in the host-overhead sections (Section.steps_per_call)
OVERHEAD_ONE, OVERHEAD_ONE_LR = "overhead-1", "overhead-1-lr"  # step() on one tensor: fixed lr, a new one each step

# Traffic models, bytes per param (see the module docstring).
BYTES_FP32_ADAM = 28
BYTES_FP32_SGD = 20
BYTES_O2_STEP = 30  # includes writing the unscaled grad back into p.grad (2), as torch's fused optimizers do
BYTES_O2_STEP_NO_WRITE = 28
BYTES_O2_CHECK = 2
BYTES_O2 = BYTES_O2_STEP + BYTES_O2_CHECK
BYTES_TORCH_O2_ACTUAL = 4 + 6 + 28 + 6
BYTES_FP32_LAMB = 4 + 24 + 16  # the global-norm pass reads grads; pass 1 reads g, p, m, v and writes m, v;
#                                pass 2 reads p, m, v and writes p
BYTES_FP32_LION = 20  # param r+w 8, grad r 4, exp_avg r+w 8
BYTES_LOWP_NO_MASTER = 22  # 16-bit param r+w 4, grad r 2, moments r+w 16
BYTES_REMAINDER = 26  # BF16 param r+w 4, int16 remainder r+w 4, grad 2, moments 16
BYTES_MASTERS_NO_UNSCALE = 28  # FP32 master r+w 8, BF16 param w 2, grad 2, moments 16
LAMB_WEIGHT_DECAY = 1e-2
LAMB_MAX_GRAD_NORM = 1.0
LION_LR = 1e-4
LION_BETAS = (0.9, 0.99)

BYTES_FOLLOW = BYTES_MASTERS_NO_UNSCALE + 4 + 10  # the step, the clamp_ (r+w 4), following it (param 2, master 8)
CLAMP = 0.5  # the clipping bound of the follow section: |w| > 0.5 for about 60% of N(0, 1) weights at the start

SECTIONS = ("adamw", "adam", "sgd", "lamb", "lion", "o2-fp16", "o2-bf16", "sr-fp16", "sr-bf16", "remainder",
            "sr-torchao", "follow", "overhead", OVERHEAD_ONE, OVERHEAD_ONE_LR)
LOW_PRECISION = {"o2-fp16": ("FP16", torch.float16), "o2-bf16": ("BF16", torch.bfloat16)}
SR_SECTIONS = {"sr-fp16": ("FP16", torch.float16), "sr-bf16": ("BF16", torch.bfloat16)}

# Method names (table rows and JSON records).
OURS_ADAMW = "mpfused FusedAdamW.step()"
OURS_ADAM = "mpfused FusedAdam.step()"
OURS_SGD = "mpfused FusedSGD.step()"
OURS_LAMB = "mpfused FusedLAMB.step()"
OURS_LION = "mpfused FusedLion.step()"
OURS_O2 = "mpfused non_finite_check_ + FusedAdamW.step() (grad_scale, found_inf)"
OURS_O2_STEP = "mpfused FusedAdamW.step() alone (grad_scale, found_inf given; no inf check)"
OURS_O2_NO_WRITE = "mpfused FusedAdamW.step() on grads needing no unscale (so no grad write-back)"
TORCH_O2 = "torch O2: unscale_ -> copy to FP32 grads -> AdamW -> copy back"
APEX_O2 = "apex FusedAdam(master_weights, capturable) + GradScaler check"
ANCHOR_LOOP, ANCHOR_FOREACH, ANCHOR_FUSED, ANCHOR_O2, ANCHOR_APEX = (
    "for-loop", "foreach", "fused", "torch O2", "apex")
ANCHOR_DEEPSPEED, ANCHOR_TORCHAO = "DeepSpeed", "torchao"
OPTIONAL_ROLES = ("apex", "deepspeed", "torchao")  # packages that are not dependencies: a failure is "n/a"
TORCHAO_SR = "torchao optim._AdamW(bf16_stochastic_round=True)"
SR_TORCHAO = "sr-torchao"
DEEPSPEED_ADAMW = "DeepSpeed DeepSpeedCPUAdam(adamw_mode=True)"
OURS_NEAREST = "mpfused FusedAdamW.step(), no masters, rounding='nearest'"
OURS_SR = "mpfused FusedAdamW.step(), no masters, rounding='stochastic'"
OVERHEAD_NEAREST = "mpfused FusedAdamW.step() FP16, no masters, rounding='nearest'"
OVERHEAD_SR = "mpfused FusedAdamW.step() FP16, no masters, rounding='stochastic'"
OURS_REMAINDER = "mpfused FusedAdamW.step(), master_weights='remainder'"
OURS_MASTERS = "mpfused FusedAdamW.step(), master_weights=True (FP32 masters)"
ANCHOR_NEAREST, ANCHOR_MASTERS = "nearest", "FP32 masters"
OURS_FOLLOW = f"mpfused clamp_({-CLAMP}, {CLAMP}) + FusedAdamW.step() (FP32 masters follow the write)"
OURS_NO_FOLLOW = "mpfused FusedAdamW.step() (FP32 masters, no write between steps)"
TORCH_FOLLOW = f"torch O2 + clipping: copy to FP32 grads -> AdamW -> masters clamp_({-CLAMP}, {CLAMP}) -> copy back"
ANCHOR_NO_WRITE, ANCHOR_O2_CLIP = "no write", "torch O2 + clamp"
TORCH_LAMB = "torch for-loop LAMB (apex semantics, written here)"
TORCH_LION_LOOP = "torch for-loop Lion (written here)"
TORCH_LION_FOREACH = "torch foreach Lion (written here)"


# ---- the param lists ----------------------------------------------------------------------------------
def parse_count(text: str) -> int:
    """A param count such as 50M, 200M, 1B (= 1G), 2e6 or 1000000."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKmMgGbB]?)\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a param count: {text!r} (examples: 2M, 50M, 1B)")
    mult = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}[m.group(2).lower()]
    value = int(round(float(m.group(1)) * mult))
    if value < 1:
        raise argparse.ArgumentTypeError(f"param count must be positive, got {text!r}")
    return value


def randn_list(sizes: list[int], device: torch.device, seed: int, std: float = 1.0,
               dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Normal tensors of the given sizes (generated in FP32 from a seeded generator, then cast)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for n in sizes:
        t = torch.randn(n, dtype=torch.float32, device=device, generator=gen)
        if std != 1.0:
            t.mul_(std)
        out.append(t if dtype == torch.float32 else t.to(dtype))
    return out


def make_params(values: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters holding ``values`` (not copied) with ``grads`` as their .grad."""
    params = []
    for v, g in zip(values, grads):
        p = torch.nn.Parameter(v)
        p.grad = g
        params.append(p)
    return params


def scalar(value: float, device: torch.device, shape: tuple = (1,)) -> torch.Tensor:
    return torch.full(shape, value, dtype=torch.float32, device=device)


# ---- measured methods ---------------------------------------------------------------------------------
@dataclass
class Method:
    """One measured way of doing a section's job. ``fn`` is None when the method is not available."""

    name: str
    role: str  # "mpfused", "torch", or an optional anchor's package (OPTIONAL_ROLES)
    fn: Optional[Callable[[], object]]
    bytes_per_param: int
    anchor: Optional[str] = None  # label when the method is a speedup anchor of its section
    na_reason: str = ""
    calls: list = field(default_factory=lambda: [0])
    step_count: Optional[Callable[[], Optional[float]]] = None  # the optimizer's step count, if it keeps one
    finite_tensors: Callable[[], list[torch.Tensor]] = lambda: []
    flags: Callable[[], list[torch.Tensor]] = lambda: []  # found_inf flags that must stay 0
    note: str = ""
    check: Callable[[], str] = lambda: ""  # after the run: "" when the method did its job, else what went wrong


def counted(fn: Callable[[], object], calls: list) -> Callable[[], object]:
    def run() -> object:
        calls[0] += 1
        return fn()
    run.__dict__.update(fn.__dict__)  # (attributes such as bench_scaler's ``standin`` travel along)
    return run


def method(name: str, role: str, fn: Optional[Callable[[], object]], bytes_per_param: int, **kw: Any) -> Method:
    m = Method(name, role, None, bytes_per_param, **kw)
    if fn is not None:
        m.fn = counted(fn, m.calls)
    return m


def first_step(opt: torch.optim.Optimizer) -> Callable[[], Optional[float]]:
    """The step count of the first param of ``opt`` (torch and mpfused keep one per param)."""
    def get() -> Optional[float]:
        p = opt.param_groups[0]["params"][0]
        step = opt.state.get(p, {}).get("step")
        return None if step is None else float(step)
    return get


def torch_fused_reason(cls: type, device: torch.device, dtype: torch.dtype = torch.float32, **kw: Any) -> str:
    """Empty when ``cls(..., fused=True)`` steps on ``device``, else why not (tried on a tiny list)."""
    try:
        p = torch.nn.Parameter(torch.zeros(8, dtype=dtype, device=device))
        p.grad = torch.zeros_like(p)
        cls([p], lr=LR, fused=True, **kw).step()
    except Exception as e:  # noqa: BLE001 - any failure means "not available here"
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]
    return ""


def deepspeed_cpu_adamw(params: list, device: torch.device, what: str, **kw: Any) -> Method:
    """DeepSpeed's CPU Adam (``deepspeed.ops.adam.DeepSpeedCPUAdam``: ZeRO-Offload's optimizer, vectorised C++
    with OpenMP that DeepSpeed builds on first use) in AdamW mode over ``params``, when DeepSpeed is installed:
    FP32 moments whatever the params' dtype, FP16/BF16 params updated without masters. n/a otherwise, and on
    CUDA (it steps CPU params; DeepSpeed's CUDA FusedAdam is not measured here)."""
    name = f"{DEEPSPEED_ADAMW} {what}" if what else DEEPSPEED_ADAMW
    if device.type != "cpu":
        return method(name, "deepspeed", None, kw.pop("nbytes"), anchor=ANCHOR_DEEPSPEED,
                      na_reason="DeepSpeedCPUAdam steps CPU params (ZeRO-Offload); not measured on CUDA")
    nbytes = kw.pop("nbytes")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam(params, adamw_mode=True, **kw)
    except Exception as e:  # noqa: BLE001 - any failure means "not available here" (missing, or its build)
        first = str(e).splitlines()[0] if str(e) else ""
        return method(name, "deepspeed", None, nbytes, anchor=ANCHOR_DEEPSPEED,
                      na_reason=f"DeepSpeed: {type(e).__name__}: {first}"[:120])
    return method(name, "deepspeed", opt.step, nbytes, anchor=ANCHOR_DEEPSPEED, step_count=first_step(opt),
                  finite_tensors=lambda: list(params))


@dataclass
class Section:
    key: str
    title: str
    model: str
    params: int
    tensors: int
    methods: list[Method]
    anchors: list[str]
    notes: list[str] = field(default_factory=list)
    # consecutive steps in one timed call (the host-overhead sections: a training loop's steady state, not
    # one step after the roof probe has emptied the caches); times and step counts are reported per step
    steps_per_call: int = 1


def fp32_section(key: str, sizes: list[int], device: torch.device) -> Section:
    """FP32 AdamW / Adam / SGD: ours and torch's for-loop, foreach and fused on shared params and grads
    (each optimizer keeps its own state)."""
    values = randn_list(sizes, device, SEED)
    grads = randn_list(sizes, device, SEED + 1, std=GRAD_STD)
    params = make_params(values, grads)
    all_variants = [(ANCHOR_LOOP, {"foreach": False}), (ANCHOR_FOREACH, {"foreach": True}),
                    (ANCHOR_FUSED, {"fused": True})]
    adam_model = "28 B/param: param r+w 8, grad r 4, exp_avg r+w 8, exp_avg_sq r+w 8"
    if key == "adamw":
        ours_cls, torch_cls, kw, ours_name = FusedAdamW, torch.optim.AdamW, {"weight_decay": WEIGHT_DECAY}, OURS_ADAMW
        title, model, nbytes, variants = "FP32 AdamW", adam_model, BYTES_FP32_ADAM, all_variants
    elif key == "adam":
        ours_cls, torch_cls, kw, ours_name = FusedAdam, torch.optim.Adam, {}, OURS_ADAM
        title, model, nbytes, variants = "FP32 Adam", adam_model, BYTES_FP32_ADAM, all_variants[2:]
    else:
        ours_cls, torch_cls, kw, ours_name = FusedSGD, torch.optim.SGD, {"momentum": MOMENTUM}, OURS_SGD
        title, model, nbytes = "FP32 SGD momentum 0.9", "20 B/param: param r+w 8, grad r 4, momentum buffer r+w 8", \
            BYTES_FP32_SGD
        variants = all_variants
    if key != "sgd":
        kw = dict(kw, betas=BETAS, eps=EPS)

    finite = lambda: list(params)  # noqa: E731 - the shared params
    ours = ours_cls(params, lr=LR, **kw)
    methods = [method(ours_name, "mpfused", ours.step, nbytes, step_count=first_step(ours), finite_tensors=finite)]
    for label, variant in variants:
        name = f"torch.optim.{torch_cls.__name__}({', '.join(f'{k}={v}' for k, v in variant.items())})"
        reason = torch_fused_reason(torch_cls, device, **kw) if variant.get("fused") else ""
        if reason:
            methods.append(method(name, "torch", None, nbytes, anchor=label, na_reason=reason))
            continue
        opt = torch_cls(params, lr=LR, **kw, **variant)
        methods.append(method(name, "torch", opt.step, nbytes, anchor=label,
                              step_count=first_step(opt) if key != "sgd" else None, finite_tensors=finite))
    anchors = [lbl for lbl, _ in variants]
    if key == "adamw":
        methods.append(deepspeed_cpu_adamw(params, device, "", lr=LR, nbytes=nbytes, **kw))
        anchors.append(ANCHOR_DEEPSPEED)
    section = Section(key, title, model, sum(sizes), len(sizes), methods, anchors)
    section.notes.append("params and grads are shared by the methods; each optimizer keeps its own state")
    return section


# ---- LAMB and Lion: torch has neither, so the anchors are written here ----------------------------------
class TorchLamb:
    """LAMB as a torch user writes it without a fused kernel: apex FusedLAMB's semantics (global-norm clip,
    AdamW-style moments with bias correction, decoupled weight decay, per-tensor trust ratio), one tensor at
    a time, no host sync (the norms and the ratio stay tensors)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
        self.step_count = 0

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        b1, b2 = BETAS
        bc1, bc2 = 1 - b1 ** self.step_count, 1 - b2 ** self.step_count
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in self.params]))
        clip = torch.where(norm > LAMB_MAX_GRAD_NORM, LAMB_MAX_GRAD_NORM / norm, torch.ones_like(norm))
        for p, (m, v) in zip(self.params, self.state):
            g = p.grad * clip
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            u = (m / bc1).div_((v / bc2).sqrt_().add_(EPS)).add_(p, alpha=LAMB_WEIGHT_DECAY)
            w_norm, u_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(u)
            ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            p.add_(u.mul_(ratio), alpha=-LR)


class TorchLion:
    """Lion as a torch user writes it (for-loop, or with torch._foreach_* ops)."""

    def __init__(self, params: list[torch.nn.Parameter], foreach: bool) -> None:
        self.params, self.foreach = params, foreach
        self.exp_avgs = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        b1, b2 = LION_BETAS
        decay = 1 - LION_LR * WEIGHT_DECAY
        grads = [p.grad for p in self.params]
        if self.foreach:
            update = torch._foreach_mul(self.exp_avgs, b1)
            torch._foreach_add_(update, grads, alpha=1 - b1)
            torch._foreach_sign_(update)
            torch._foreach_mul_(self.params, decay)
            torch._foreach_add_(self.params, update, alpha=-LION_LR)
            torch._foreach_mul_(self.exp_avgs, b2)
            torch._foreach_add_(self.exp_avgs, grads, alpha=1 - b2)
            return
        for p, g, m in zip(self.params, grads, self.exp_avgs):
            update = m.mul(b1).add_(g, alpha=1 - b1).sign_()
            p.mul_(decay).add_(update, alpha=-LION_LR)
            m.mul_(b2).add_(g, alpha=1 - b2)


def lamb_lion_section(key: str, sizes: list[int], device: torch.device) -> Section:
    """FP32 LAMB or Lion: ours against the torch implementations above, on shared params and grads (each
    keeps its own state)."""
    values = randn_list(sizes, device, SEED)
    grads = randn_list(sizes, device, SEED + 1, std=GRAD_STD)
    params = make_params(values, grads)
    finite = lambda: list(params)  # noqa: E731 - the shared params
    if key == "lamb":
        ours = FusedLAMB(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=LAMB_WEIGHT_DECAY,
                         max_grad_norm=LAMB_MAX_GRAD_NORM)
        anchor = TorchLamb(params)
        methods = [method(OURS_LAMB, "mpfused", ours.step, BYTES_FP32_LAMB, step_count=first_step(ours),
                          finite_tensors=finite),
                   method(TORCH_LAMB, "torch", anchor.step, BYTES_FP32_LAMB, anchor=ANCHOR_LOOP,
                          finite_tensors=finite)]
        model = (f"{BYTES_FP32_LAMB} B/param: the global grad norm reads grads 4; pass 1 reads grad, param, "
                 "exp_avg, exp_avg_sq 16 and writes the moments 8; pass 2 reads param and moments 12, writes param 4")
        return Section(key, f"FP32 LAMB (max_grad_norm {LAMB_MAX_GRAD_NORM:g}, weight decay {LAMB_WEIGHT_DECAY:g})",
                       model, sum(sizes), len(sizes), methods, [ANCHOR_LOOP])
    ours = FusedLion(params, lr=LION_LR, betas=LION_BETAS, weight_decay=WEIGHT_DECAY)
    methods = [method(OURS_LION, "mpfused", ours.step, BYTES_FP32_LION, finite_tensors=finite)]
    for name, label, foreach in ((TORCH_LION_LOOP, ANCHOR_LOOP, False), (TORCH_LION_FOREACH, ANCHOR_FOREACH, True)):
        methods.append(method(name, "torch", TorchLion(params, foreach).step, BYTES_FP32_LION, anchor=label,
                              finite_tensors=finite))
    model = f"{BYTES_FP32_LION} B/param: param r+w 8, grad r 4, exp_avg r+w 8"
    return Section(key, f"FP32 Lion (weight decay {WEIGHT_DECAY:g})", model, sum(sizes), len(sizes), methods,
                   [ANCHOR_LOOP, ANCHOR_FOREACH])


def precision_section(key: str, sizes: list[int], device: torch.device) -> Section:
    """The precision modes of FusedAdamW on 16-bit params, each on its own copy of the params (they write
    them) with shared grads (read only): stochastic against round-to-nearest write-back without masters
    (sr-fp16, sr-bf16), and BF16 remainders against FP32 masters (remainder)."""
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    dtype = SR_SECTIONS[key][1] if key in SR_SECTIONS else torch.bfloat16
    grads = randn_list(sizes, device, SEED + 1, std=GRAD_STD, dtype=dtype)
    if key in SR_SECTIONS:
        variants = [(OURS_NEAREST, ANCHOR_NEAREST, dict(master_weights=False, rounding="nearest"),
                     BYTES_LOWP_NO_MASTER),
                    (OURS_SR, None, dict(master_weights=False, rounding="stochastic", seed=SEED),
                     BYTES_LOWP_NO_MASTER)]
        title = f"{SR_SECTIONS[key][0]} AdamW without masters: stochastic vs nearest write-back"
        model = f"{BYTES_LOWP_NO_MASTER} B/param: param r+w 4, grad r 2, exp_avg and exp_avg_sq r+w 16"
        notes = []
    else:
        variants = [(OURS_MASTERS, ANCHOR_MASTERS, dict(master_weights=True), BYTES_MASTERS_NO_UNSCALE),
                    (OURS_REMAINDER, None, dict(master_weights="remainder"), BYTES_REMAINDER)]
        title = "BF16 AdamW: remainder (2 B/param of master) vs FP32 masters (4 B/param)"
        model = (f"{BYTES_REMAINDER} B/param with remainders (param r+w 4, remainder r+w 4, grad 2, moments 16); "
                 f"{BYTES_MASTERS_NO_UNSCALE} with FP32 masters (master r+w 8, param w 2, grad 2, moments 16)")
        notes = ["the two updates are bit-identical (tests/test_optim_precision.py); the remainder saves 2 B/param "
                 "of memory and 2 B/param of traffic per step"]
    methods = []
    for name, anchor, mode, nbytes in variants:
        params = make_params(randn_list(sizes, device, SEED, dtype=dtype), grads)
        opt = FusedAdamW(params, **kw, **mode)

        def finite(opt=opt, params=params) -> list[torch.Tensor]:
            return list(params) + [opt.state[p]["master_param"] for p in params if "master_param" in opt.state[p]]
        methods.append(method(name, "mpfused", opt.step, nbytes, anchor=anchor, step_count=first_step(opt),
                              finite_tensors=finite))
    anchors = [ANCHOR_NEAREST] if key in SR_SECTIONS else [ANCHOR_MASTERS]
    if key in SR_SECTIONS:  # DeepSpeed's CPU Adam does the nearest row's job: 16-bit params, FP32 moments
        params = make_params(randn_list(sizes, device, SEED, dtype=dtype), grads) if device.type == "cpu" else []
        methods.append(deepspeed_cpu_adamw(params, device, f"on {SR_SECTIONS[key][0]} params (no masters)",
                                           nbytes=BYTES_LOWP_NO_MASTER, **kw))
        anchors.append(ANCHOR_DEEPSPEED)
    return Section(key, title, model, sum(sizes), len(sizes), methods, anchors, notes)


def transformer_sizes(total: int) -> list[int]:
    """The element counts of a decoder-only transformer's params, about ``total`` in all: a token embedding
    of width d (1024 from 100M params, 512 from 10M, else 128) with up to 32,000 rows and at most a third of
    the total, then layers of a fused QKV matrix (3d x d) and its bias, the output projection (d x d) and its
    bias, the MLP (4d x d, d x 4d) and its biases, and two LayerNorms (weight and bias each), as many layers
    as the rest holds (at least one): few distinct shapes, many tensors of each, as in a real model (torchao
    compiles its step once per shape)."""
    d = 1024 if total >= 100_000_000 else 512 if total >= 10_000_000 else 128
    embedding = d * max(1, min(32_000, total // 3 // d))
    layer = [3 * d * d, 3 * d, d * d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d, d, d]
    layers = max(1, round((total - embedding) / sum(layer)))
    return [embedding] + layer * layers


def torchao_section(total: int, device: torch.device) -> Section:
    """BF16 AdamW without masters, stochastic write-back: ours against torchao's ``_AdamW(bf16_stochastic_round=
    True)`` (torchao's AdamW for BF16 params: FP32 moments, the update in FP32 and the param written with
    stochastic rounding, one ``torch.compile``d kernel per param), when torchao is installed; and our
    round-to-nearest step. On a transformer's shapes (transformer_sizes), since torchao compiles once per
    shape (the model-like list's 300 distinct sizes would take it minutes of compiling). Each on its own
    copy of the params, the grads shared."""
    sizes = transformer_sizes(total)
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    grads = randn_list(sizes, device, SEED + 1, std=GRAD_STD, dtype=torch.bfloat16)
    methods = []
    for name, mode in ((OURS_SR, dict(rounding="stochastic", seed=SEED)), (OURS_NEAREST, dict(rounding="nearest"))):
        params = make_params(randn_list(sizes, device, SEED, dtype=torch.bfloat16), grads)
        opt = FusedAdamW(params, master_weights=False, **kw, **mode)
        methods.append(method(name, "mpfused", opt.step, BYTES_LOWP_NO_MASTER, step_count=first_step(opt),
                              finite_tensors=lambda params=params: list(params)))
    params = make_params(randn_list(sizes, device, SEED, dtype=torch.bfloat16), grads)
    try:
        from torchao.optim import _AdamW as TorchaoAdamW
        ao = TorchaoAdamW(params, **kw, bf16_stochastic_round=True)
    except Exception as e:  # noqa: BLE001 - any failure means "not available here"
        first = str(e).splitlines()[0] if str(e) else ""
        methods.append(method(TORCHAO_SR, "torchao", None, BYTES_LOWP_NO_MASTER, anchor=ANCHOR_TORCHAO,
                              na_reason=f"torchao: {type(e).__name__}: {first}"[:120]))
    else:
        methods.append(method(TORCHAO_SR, "torchao", ao.step, BYTES_LOWP_NO_MASTER, anchor=ANCHOR_TORCHAO,
                              step_count=first_step(ao), finite_tensors=lambda: list(params)))
    title = "BF16 AdamW without masters, stochastic write-back: ours vs torchao (a transformer's shapes)"
    model = f"{BYTES_LOWP_NO_MASTER} B/param: param r+w 4, grad r 2, exp_avg and exp_avg_sq r+w 16"
    notes = [f"a transformer's params ({len(sizes)} tensors, {len(set(sizes))} shapes; transformer_sizes); "
             "torchao's first step, which compiles a kernel per shape, is not timed (as every method's first step)"]
    return Section(SR_TORCHAO, title, model, sum(sizes), len(sizes), methods, [ANCHOR_TORCHAO], notes)


def follow_section(sizes: list[int], device: torch.device) -> Section:
    """Weight clipping on an FP16 model with FP32 masters: a clamp_ of every param before every step, which the
    step's masters follow (one pass, csrc/core/follow.h); against torch's O2 pipeline clipping its masters, and
    against our step with no write between steps. Each method has its own params (they write them); the grads
    are shared (read only: nothing unscales them)."""
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    grads = randn_list(sizes, device, SEED + 1, std=GRAD_STD, dtype=torch.float16)
    methods = []
    for name, anchor, clip in ((OURS_FOLLOW, None, True), (OURS_NO_FOLLOW, ANCHOR_NO_WRITE, False)):
        params = make_params(randn_list(sizes, device, SEED, dtype=torch.float16), grads)
        opt = FusedAdamW(params, **kw)

        def run(opt=opt, params=params, clip=clip) -> None:
            if clip:
                with torch.no_grad():
                    for p in params:  # (one pass each: torch has no foreach clamp of both ends)
                        p.clamp_(-CLAMP, CLAMP)
            opt.step()

        def finite(opt=opt, params=params) -> list[torch.Tensor]:
            return list(params) + [opt.state[p]["master_param"] for p in params if "master_param" in opt.state[p]]

        def followed(opt=opt, params=params, clip=clip) -> str:
            # The step after a clamp_ starts from the clamped values: its masters lie within one update of the
            # bound. Masters that did not follow drift past it step after step.
            if not clip:
                return ""
            worst = max(float(opt.state[p]["master_param"].abs().max()) for p in params if p.numel())
            return "" if worst <= CLAMP + 2 * LR else f"masters up to {worst:.6f}, past the clamp {CLAMP} + 2 lr: not followed"
        methods.append(method(name, "mpfused", run, BYTES_FOLLOW if clip else BYTES_MASTERS_NO_UNSCALE,
                              anchor=anchor, step_count=first_step(opt), finite_tensors=finite, check=followed))

    lp = [p.detach() for p in make_params(randn_list(sizes, device, SEED, dtype=torch.float16), grads)]
    masters = make_params([p.float() for p in lp], [torch.zeros(p.shape, device=device) for p in lp])
    master_data, master_grads = [m.detach() for m in masters], [m.grad for m in masters]
    fused_reason = torch_fused_reason(torch.optim.AdamW, device, weight_decay=WEIGHT_DECAY)
    topt = torch.optim.AdamW(masters, **kw, **(dict(fused=True) if not fused_reason else dict(foreach=True)))

    def torch_clip() -> None:
        torch._foreach_copy_(master_grads, grads)
        topt.step()
        for m in master_data:  # (one pass each, as ours)
            m.clamp_(-CLAMP, CLAMP)
        torch._foreach_copy_(lp, master_data)

    def torch_clipped() -> str:
        worst = max(float(m.abs().max()) for m in master_data if m.numel())
        return "" if worst <= CLAMP else f"masters up to {worst:.6f}, past the clamp {CLAMP}"

    how = "fused=True" if not fused_reason else f"foreach=True (fused n/a: {fused_reason})"
    methods.append(method(TORCH_FOLLOW, "torch", torch_clip, BYTES_FOLLOW, anchor=ANCHOR_O2_CLIP,
                          step_count=first_step(topt), finite_tensors=lambda: lp + master_data, note=how,
                          check=torch_clipped))
    model = (f"{BYTES_FOLLOW} B/param: the step with FP32 masters {BYTES_MASTERS_NO_UNSCALE}, the clamp_ 4, following "
             f"it 10; our step alone {BYTES_MASTERS_NO_UNSCALE}")
    return Section("follow", f"FP16 AdamW with FP32 masters, a clamp_ to +-{CLAMP} of every param before every step",
                   model, sum(sizes), len(sizes), methods, [ANCHOR_O2_CLIP, ANCHOR_NO_WRITE],
                   [f"torch's AdamW: {how}; its pipeline moves about 48 B/param but is charged {BYTES_FOLLOW}"])


def o2_section(key: str, sizes: list[int], device: torch.device) -> Section:
    """O2 AdamW on FP16 or BF16 params: ours (check + step, and step alone) against torch's pipeline and
    apex. torch's pipeline and apex get their own copies of the params and grads (the pipeline writes both)."""
    label, dtype = LOW_PRECISION[key]

    def copies() -> list[torch.nn.Parameter]:
        """The same values every call (seeded); the grads are the scaled ones, as backward leaves them."""
        return make_params(randn_list(sizes, device, SEED, dtype=dtype),
                           randn_list(sizes, device, SEED + 1, std=GRAD_STD * LOSS_SCALE, dtype=dtype))

    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    methods: list[Method] = []
    notes: list[str] = []

    # ours: the full job (check, then the step) and the step alone, each an optimizer over its own copy of the
    # params and grads. (Over one copy, as they once were, the calls interleave: each optimizer found the
    # params written by the other and followed that write, a pass more per call; and each toggled the shared
    # grads' scale on its own, unscaling them twice in a row, which left FP16 grads 95% zeros.)
    # Each step leaves the grads unscaled (written back): like torch's pipeline below, the calls alternate
    # grad_scale between S and 1/S, so the grads alternate between their scaled and unscaled values.
    scales = (scalar(LOSS_SCALE, device), scalar(1.0 / LOSS_SCALE, device))
    for full in (True, False):
        lp = copies()
        opt = FusedAdamW(lp, **kw)
        found = scalar(0.0, device)
        opt.found_inf = found
        grads = [p.grad for p in lp]

        def ours_step(opt=opt, toggle=[0]) -> None:
            opt.grad_scale = scales[toggle[0]]
            toggle[0] ^= 1
            opt.step()
        if full:
            def ours_full(grads=grads, found=found, step=ours_step) -> None:
                mpfused.non_finite_check_(grads, found)
                step()
            fn, name, nbytes = ours_full, OURS_O2, BYTES_O2
        else:
            fn, name, nbytes = ours_step, OURS_O2_STEP, BYTES_O2_STEP

        def masters(opt=opt, lp=lp) -> list[torch.Tensor]:
            return list(lp) + [opt.state[p]["master_param"] for p in lp if "master_param" in opt.state[p]]
        methods.append(method(name, "mpfused", fn, nbytes, step_count=first_step(opt), finite_tensors=masters,
                              flags=lambda found=found: [found]))

    # The cost of leaving p.grad unscaled (written back in the same pass): the same step on grads that need
    # no unscale, which the kernel then does not write.
    plain = make_params(randn_list(sizes, device, SEED, dtype=dtype),
                        randn_list(sizes, device, SEED + 1, std=GRAD_STD, dtype=dtype))
    opt_plain = FusedAdamW(plain, **kw)
    found_plain = scalar(0.0, device)
    opt_plain.found_inf = found_plain
    methods.append(method(OURS_O2_NO_WRITE, "mpfused", opt_plain.step, BYTES_O2_STEP_NO_WRITE,
                          step_count=first_step(opt_plain),
                          finite_tensors=lambda: list(plain) + [opt_plain.state[p]["master_param"] for p in plain],
                          flags=lambda: [found_plain]))

    # torch's O2 pipeline
    lp = copies()
    lp_data = [p.detach() for p in lp]
    lp_grads = [p.grad for p in lp]
    master_params = make_params([p.detach().float() for p in lp], [torch.zeros(p.shape, device=device) for p in lp])
    master_data = [m.detach() for m in master_params]
    master_grads = [m.grad for m in master_params]
    found_t = scalar(0.0, device, ())  # torch's flags are 0-dim, as GradScaler makes them
    inv_scales = (scalar(1.0 / LOSS_SCALE, device, ()), scalar(LOSS_SCALE, device, ()))
    toggle = [0]
    fused_reason = torch_fused_reason(torch.optim.AdamW, device, weight_decay=WEIGHT_DECAY)
    if not fused_reason:
        topt = torch.optim.AdamW(master_params, fused=True, **kw)
        topt.found_inf = found_t  # fused AdamW skips on the device when the flag is set (no host sync)

        def step_masters() -> None:
            topt.step()
        how = "fused=True, found_inf on the device"
    else:
        topt = torch.optim.AdamW(master_params, foreach=True, **kw)

        def step_masters() -> None:
            if found_t.item() == 0.0:  # foreach cannot skip on the device: GradScaler's host check
                topt.step()
        how = f"foreach=True + host check of found_inf (fused n/a: {fused_reason})"

    amp_unscale = torch_amp_unscale(device, lp_grads[0].dtype if lp_grads else torch.float32)
    if getattr(amp_unscale, "stand_in", ""):
        how += f"; step (a): {amp_unscale.stand_in}"

    def torch_o2() -> None:
        amp_unscale(lp_grads, found_t, inv_scales[toggle[0]])  # (a)
        toggle[0] ^= 1
        torch._foreach_copy_(master_grads, lp_grads)  # (b)
        step_masters()  # (c)
        torch._foreach_copy_(lp_data, master_data)  # (d)

    methods.append(method(TORCH_O2, "torch", torch_o2, BYTES_O2, anchor=ANCHOR_O2, step_count=first_step(topt),
                          finite_tensors=lambda: lp_data + master_data, flags=lambda: [found_t],
                          note=how))
    notes.append(f"torch O2 step (c): AdamW {how}; the pipeline moves ~{BYTES_TORCH_O2_ACTUAL} B/param "
                 f"but is charged the job's {BYTES_O2} B/param")

    # apex, when importable (CUDA only)
    apex_method, apex_note = apex_o2_method(copies, device, kw)
    methods.append(apex_method)
    notes.append(apex_note)
    return Section(key, f"O2 {label} AdamW (FP32 masters, loss scale {LOSS_SCALE:g})",
                   "32 B/param: 30 (master r+w 8, grad r+w 4, moments 16, low-precision param w 2) + 2 for "
                   "the inf check; step() alone 30; without the grad write-back 28", sum(sizes), len(sizes), methods, [ANCHOR_O2, ANCHOR_APEX], notes)


def installed_version(package: str) -> str:
    """The installed version of ``package`` (from its metadata: nothing is imported), or "not installed"."""
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def torchao_importable() -> str:
    """Empty when ``torchao.optim._AdamW`` imports, else why not."""
    try:
        from torchao.optim import _AdamW  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]
    return ""


def apex_importable() -> str:
    """Empty when ``import apex`` works, else why not."""
    try:
        import apex  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return ""


def apex_o2_method(copies: Callable[[], list], device: torch.device, kw: dict) -> tuple[Method, str]:
    """apex FusedAdam with master weights, capturable, stepped with a torch GradScaler (apex then runs the
    scaler's inf check and unscales in its kernel); "n/a" with the reason where that cannot run."""
    reason = apex_importable()
    if reason:
        return method(APEX_O2, "apex", None, BYTES_O2, anchor=ANCHOR_APEX, na_reason="apex: not importable"), \
            f"apex: not importable ({reason})"
    if device.type != "cuda":
        return method(APEX_O2, "apex", None, BYTES_O2, anchor=ANCHOR_APEX, na_reason="apex is CUDA only"), \
            "apex: importable, but its FusedAdam runs on CUDA only"
    try:
        from apex.optimizers import FusedAdam as ApexFusedAdam

        lp = copies()
        opt = ApexFusedAdam(lp, lr=kw["lr"], betas=kw["betas"], eps=kw["eps"], weight_decay=kw["weight_decay"],
                            adam_w_mode=True, master_weights=True, capturable=True)
        scaler = torch.amp.GradScaler(device.type, init_scale=LOSS_SCALE)
        scaler._lazy_init_scale_growth_tracker(device)  # what scaler.scale(loss) would do first

        def apex_step() -> None:
            opt.step(grad_scaler=scaler)
        apex_step()  # raises here, not in the timing, if this apex has another API
        m = method(APEX_O2, "apex", apex_step, BYTES_O2, anchor=ANCHOR_APEX, finite_tensors=lambda: list(lp))
        return m, "apex: FusedAdam(adam_w_mode=True, master_weights=True, capturable=True).step(grad_scaler=...)"
    except Exception as e:  # noqa: BLE001
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]
        return method(APEX_O2, "apex", None, BYTES_O2, anchor=ANCHOR_APEX, na_reason=f"apex failed: {why}"), \
            f"apex: importable but failed ({why})"


def overhead_section(device: torch.device) -> Section:
    """Per-step cost that does not scale with the params: 300 one-element tensors."""
    sizes = [1] * OVERHEAD_TENSORS
    methods = []
    for label, dtype in (("FP32", torch.float32), ("FP16 O2", torch.float16)):
        params = make_params(randn_list(sizes, device, SEED, dtype=dtype),
                             randn_list(sizes, device, SEED + 1, std=GRAD_STD, dtype=dtype))
        opt = FusedAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
        if dtype != torch.float32:
            opt.grad_scale = scalar(1.0, device)
            opt.found_inf = scalar(0.0, device)
        name = f"mpfused FusedAdamW.step() {label}" + (" (grad_scale, found_inf)" if label != "FP32" else "")
        name = OVERHEAD_OURS if label == "FP32" else name
        methods.append(method(name, "mpfused", opt.step, BYTES_FP32_ADAM, step_count=first_step(opt),
                              finite_tensors=lambda params=params: list(params)))
    for name, rounding in ((OVERHEAD_NEAREST, "nearest"), (OVERHEAD_SR, "stochastic")):
        # the stochastic step's own host work (each param's offset in the random stream) against nearest's
        params = make_params(randn_list(sizes, device, SEED, dtype=torch.float16),
                             randn_list(sizes, device, SEED + 1, std=GRAD_STD, dtype=torch.float16))
        opt = FusedAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, master_weights=False, rounding=rounding, seed=SEED)
        methods.append(method(name, "mpfused", opt.step, BYTES_LOWP_NO_MASTER, step_count=first_step(opt),
                              finite_tensors=lambda params=params: list(params)))
    reason = torch_fused_reason(torch.optim.AdamW, device)
    params = make_params(randn_list(sizes, device, SEED), randn_list(sizes, device, SEED + 1, std=GRAD_STD))
    if reason:
        methods.append(method("torch.optim.AdamW(fused=True) FP32", "torch", None, BYTES_FP32_ADAM,
                              anchor=ANCHOR_FUSED, na_reason=reason))
    else:
        topt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        methods.append(method("torch.optim.AdamW(fused=True) FP32", "torch", topt.step, BYTES_FP32_ADAM,
                              anchor=ANCHOR_FUSED, step_count=first_step(topt),
                              finite_tensors=lambda: list(params)))
    return Section("overhead", f"Host overhead: step() on {OVERHEAD_TENSORS} one-element tensors", "not bandwidth",
                   OVERHEAD_TENSORS, OVERHEAD_TENSORS, methods, [ANCHOR_FUSED], steps_per_call=OVERHEAD_BURST)


OVERHEAD_OURS = "mpfused FusedAdamW.step() FP32"
OVERHEAD_TORCH = "torch.optim.AdamW(fused=True) FP32"


def with_new_lr(opt: torch.optim.Optimizer) -> Callable[[], object]:
    """``opt.step`` after setting its lr to a new float object, as an lr scheduler does before every step
    (the value alternates between two, so the numbers stay those of a fixed lr)."""
    group = opt.param_groups[0]
    count = itertools.count()

    def step() -> object:
        group["lr"] = LR * (1.0 + (next(count) % 2) * 1e-6)
        return opt.step()

    return step


def overhead_one_section(device: torch.device, new_lr: bool) -> Section:
    """Per-step cost on a one-tensor model: each step() is its host work and one tiny update; with
    ``new_lr``, the lr is set anew before every step, as a scheduler does."""
    how = (lambda opt: with_new_lr(opt)) if new_lr else (lambda opt: opt.step)
    params = make_params(randn_list([1], device, SEED), randn_list([1], device, SEED + 1, std=GRAD_STD))
    opt = FusedAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    methods = [method(OVERHEAD_OURS, "mpfused", how(opt), BYTES_FP32_ADAM, step_count=first_step(opt),
                      finite_tensors=lambda: list(params))]
    reason = torch_fused_reason(torch.optim.AdamW, device)
    if reason:
        methods.append(method(OVERHEAD_TORCH, "torch", None, BYTES_FP32_ADAM, anchor=ANCHOR_FUSED, na_reason=reason))
    else:
        tparams = make_params(randn_list([1], device, SEED), randn_list([1], device, SEED + 1, std=GRAD_STD))
        topt = torch.optim.AdamW(tparams, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        methods.append(method(OVERHEAD_TORCH, "torch", how(topt), BYTES_FP32_ADAM, anchor=ANCHOR_FUSED,
                              step_count=first_step(topt), finite_tensors=lambda: list(tparams)))
    title = "Host overhead: step() on one one-element tensor" + (", a new lr every step (as a scheduler sets)"
                                                                   if new_lr else ", fixed lr")
    return Section(OVERHEAD_ONE_LR if new_lr else OVERHEAD_ONE, title, "not bandwidth", 1, 1, methods, [ANCHOR_FUSED],
                   steps_per_call=OVERHEAD_BURST)


# ---- other processes during a section ------------------------------------------------------------------
class OtherLoad:
    """Fraction of all cpus' time that other processes kept busy between :meth:`start` and :meth:`stop`:
    the busy time in /proc/stat less this process's own cpu time. The harness's ``cpu_busy_fraction``
    samples only before and after the run, while the benchmark is idle; a section that another process
    interrupts is flagged with this. None where /proc/stat is not available."""

    def __init__(self) -> None:
        self._t0: Optional[tuple[float, float, float]] = None

    @staticmethod
    def _sample() -> Optional[tuple[float, float, float]]:
        try:
            with open("/proc/stat", encoding="utf-8") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
            tick = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        own = os.times()
        return sum(fields) / tick, (sum(fields) - idle) / tick, own.user + own.system

    def start(self) -> None:
        self._t0 = self._sample()

    def stop(self) -> Optional[float]:
        t1 = self._sample()
        if self._t0 is None or t1 is None or t1[0] <= self._t0[0]:
            return None
        total, busy, own = (b - a for a, b in zip(self._t0, t1))
        return round(min(1.0, max(0.0, (busy - own) / total)), 3)


# ---- memory -------------------------------------------------------------------------------------------
def bytes_needed(key: str, params: int, with_apex: bool) -> int:
    """Rough peak of a section: its tensors, the optimizers' state and temporaries (the roof probe is
    already allocated when the free memory is read)."""
    # ours' params+grads and 2x masters+moments, the no-write-back copy with its masters+moments, torch's
    # pipeline, apex, generation temporaries
    o2 = 4 + 2 * 12 + (4 + 12) + 20 + (16 if with_apex else 0) + 4
    per_param = {
        "adamw": 8 + 5 * 8 + 12,  # shared param+grad, 5 optimizers' moments (DeepSpeed's), foreach temporaries
        "adam": 8 + 2 * 8 + 4,
        "sgd": 8 + 4 * 4 + 8,
        "lamb": 8 + 2 * 8 + 12,  # shared param+grad, two optimizers' moments, the torch loop's temporaries
        "lion": 8 + 3 * 4 + 8,
        "o2-fp16": o2,
        "o2-bf16": o2,
        "sr-fp16": 2 + 3 * 20 + 4,  # shared grads, three optimizers' params and moments (DeepSpeed's), temporaries
        "sr-bf16": 2 + 3 * 20 + 4,
        "remainder": 2 + 22 + 24 + 4,  # shared grads; param, remainder, moments; param, master, moments
        SR_TORCHAO: 2 + 3 * 20 + 4,  # shared grads, three optimizers' params and moments, temporaries
        "follow": 2 + 2 * 22 + 24 + 4,  # shared grads; ours twice (param, master, moments); torch's pipeline
        "overhead": 0,
        OVERHEAD_ONE: 0,
        OVERHEAD_ONE_LR: 0,
    }[key]
    return per_param * params


def memory_available(device: torch.device) -> Optional[int]:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- agreement check ----------------------------------------------------------------------------------
def check_agreement(device: torch.device) -> None:
    """Before timing, on a small list: ours and torch agree after two steps (FP32 AdamW vs the for-loop
    AdamW, FusedSGD vs SGD, O2 FP16 masters vs torch's pipeline), so the benchmark measures working
    code. Raises when they do not."""
    sizes = [1000, 4097, 33, 70000]

    def pair(ours_cls, torch_cls, **kw):
        a = make_params(randn_list(sizes, device, 7), randn_list(sizes, device, 8, std=GRAD_STD))
        b = make_params([p.detach().clone() for p in a], [p.grad.clone() for p in a])
        oa, ob = ours_cls(a, lr=LR, **kw), torch_cls(b, lr=LR, foreach=False, **kw)
        for _ in range(2):
            oa.step()
            ob.step()
        for x, y in zip(a, b):
            torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"{ours_cls.__name__} vs {torch_cls.__name__}: {m}")

    pair(FusedAdamW, torch.optim.AdamW, weight_decay=WEIGHT_DECAY)
    pair(FusedAdam, torch.optim.Adam)
    pair(FusedSGD, torch.optim.SGD, momentum=MOMENTUM)

    lp = make_params(randn_list(sizes, device, 7, dtype=torch.float16),
                     randn_list(sizes, device, 8, std=GRAD_STD * LOSS_SCALE, dtype=torch.float16))
    ref = [p.detach().float() for p in lp]
    ref_params = make_params(ref, [(p.grad.float() / LOSS_SCALE) for p in lp])
    opt = FusedAdamW(lp, lr=LR, weight_decay=WEIGHT_DECAY)
    opt.grad_scale = scalar(LOSS_SCALE, device)
    opt.found_inf = scalar(0.0, device)
    topt = torch.optim.AdamW(ref_params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
    scaled = [p.grad.clone() for p in lp]
    for _ in range(2):
        for p, g in zip(lp, scaled):  # a new backward: the step leaves p.grad unscaled
            p.grad.copy_(g)
        opt.step()
        topt.step()
        for p, r in zip(lp, ref_params):
            torch.testing.assert_close(p.grad, r.grad.half(), rtol=0, atol=0,
                                       msg=lambda m: f"O2 FP16 grads after the step vs the unscaled grads: {m}")
    for p, r in zip(lp, ref_params):
        torch.testing.assert_close(opt.state[p]["master_param"], r.detach(), rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"O2 FP16 masters vs torch AdamW on FP32 copies: {m}")
        torch.testing.assert_close(p.detach(), opt.state[p]["master_param"].half(), rtol=0, atol=0,
                                   msg=lambda m: f"O2 FP16 params vs their rounded masters: {m}")
    skipped = FusedAdamW(lp, lr=LR)
    skipped.grad_scale = scalar(LOSS_SCALE, device)
    skipped.found_inf = scalar(1.0, device)
    before = [p.detach().clone() for p in lp]
    skipped.step()
    if any(not torch.equal(p.detach(), q) for p, q in zip(lp, before)):
        raise RuntimeError("FusedAdamW wrote the params although found_inf was set")


# ---- measurement and report ---------------------------------------------------------------------------
def all_finite(tensors: list[torch.Tensor]) -> bool:
    if not tensors:
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all().item())


def measure_section(section: Section, args: argparse.Namespace, probe: RoofProbe) -> tuple[Roofs, list[dict]]:
    device = args.device
    for m in section.methods:  # the first step creates the optimizer state (lazily, like torch): never timed
        if m.fn is None:
            continue
        if m.role not in OPTIONAL_ROLES:
            m.fn()
            continue
        try:  # an optional anchor's package may be installed and still fail (its build, its version): n/a
            m.fn()
        except Exception as e:  # noqa: BLE001
            first = str(e).splitlines()[0] if str(e) else ""
            m.fn, m.na_reason = None, f"its first step raised {type(e).__name__}: {first}"[:120]
    live = [m for m in section.methods if m.fn is not None]
    load = OtherLoad()
    load.start()
    synchronize_all(device)
    repeats = max(args.repeats, 20) if section.key.startswith("overhead") else args.repeats
    burst = section.steps_per_call
    fns = [m.fn if burst == 1 else (lambda fn=m.fn: [fn() for _ in range(burst)]) for m in live]
    read, copy, *timings = time_interleaved([probe.read, probe.copy] + fns, device, warmup=args.warmup,
                                            repeats=repeats, max_seconds=args.max_seconds)
    timings = [Timing(tuple(s / burst for s in t.samples_s)) for t in timings]
    others_busy = load.stop()
    roofs = probe.roofs(read, copy)
    timing_of = {id(m): t for m, t in zip(live, timings)}
    kernels_of = {id(m): count_cuda_kernels(m.fn, device) for m in live}
    anchor_time = {m.anchor: timing_of[id(m)].median for m in live if m.anchor}
    synchronize_all(device)

    records = []
    for m in section.methods:
        rec: dict[str, Any] = {
            "section": section.key, "title": section.title, "method": m.name, "role": m.role,
            "anchor": m.anchor, "tensors": section.tensors, "params": section.params,
            "bytes_per_param": m.bytes_per_param, "available": m.fn is not None, "na_reason": m.na_reason or None,
            "note": m.note or None, "others_busy_during_section": others_busy,
        }
        if m.fn is not None:
            t = timing_of[id(m)]
            bps = section.params * m.bytes_per_param / t.median
            steps = m.step_count() if m.step_count else None
            flags = [float(f.item()) for f in m.flags()]
            rec.update({
                "timing": t.to_dict(),
                "params_per_s": section.params / t.median,
                "GBps": bps / GB,
                "copy_roof_GBps": roofs.copy_Bps / GB,
                "pct_copy_roof": 100.0 * bps / roofs.copy_Bps,
                "speedup_vs": {a: anchor_time[a] / t.median for a in section.anchors if a in anchor_time},
                "kernels_per_step": kernels_of[id(m)],
                "calls": m.calls[0],
                "step_count": steps,
                "steps_per_call": burst,
                "steps_match_calls": None if steps is None else steps == m.calls[0],
                "found_inf_after": flags,
                "finite_after": all_finite(m.finite_tensors()),
                "check_after": m.check(),
            })
        records.append(rec)
    return roofs, records


def synchronize_all(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fmt_x(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.2f}x"


def print_section(section_records: list[dict], roofs: Roofs, device: torch.device, anchors: list[str],
                  title: str, model: str) -> None:
    on_cuda = device.type == "cuda"
    overhead = section_records[0]["section"].startswith("overhead")
    columns = ["method", "median ms", "IQR ms", "n"]
    if overhead:
        columns += ["us/tensor"]
    else:
        columns += ["Mparam/s", "B/param", "GB/s", "% copy roof"]
    columns += [f"vs {a}" for a in anchors]
    if on_cuda:
        columns.append("kernels/step")
    rows = []
    params = section_records[0]["params"]
    if not overhead:
        nbytes = max(r["bytes_per_param"] for r in section_records)
        seconds = params * nbytes / roofs.copy_Bps
        rows.append([f"copy roof: {nbytes} B/param at y.copy_(x) bandwidth", f"{seconds * 1e3:.2f}", "",
                     str(len(roofs.copy.samples_s)), f"{params / seconds / 1e6:.0f}", str(nbytes),
                     f"{roofs.copy_Bps / GB:.1f}", "100.0"] + [""] * len(anchors) + ([""] if on_cuda else []))
    for r in section_records:
        if not r["available"]:
            width = len(columns) - 1
            rows.append([r["method"], f"n/a: {r['na_reason']}"] + [""] * (width - 1))
            continue
        t = r["timing"]
        row = [r["method"], f"{t['median_s'] * 1e3:.2f}", f"{t['iqr_s'] * 1e3:.2f}", str(t["repeats"])]
        if overhead:
            row.append(f"{t['median_s'] * 1e6 / r['tensors']:.1f}")
        else:
            row += [f"{r['params_per_s'] / 1e6:.0f}", str(r["bytes_per_param"]), f"{r['GBps']:.1f}",
                    f"{r['pct_copy_roof']:.1f}"]
        row += [fmt_x(r["speedup_vs"].get(a)) if a in r["speedup_vs"] else "n/a" for a in anchors]
        if on_cuda:
            row.append(str(r["kernels_per_step"]))
        rows.append(row)
    numeric = [False] + [True] * (len(columns) - 1)
    where = "" if overhead else f"; {params / 1e6:.1f}M params in {section_records[0]['tensors']} tensors; {model}"
    burst = next((r["steps_per_call"] for r in section_records if r["available"]), 1)
    if burst > 1:
        where += f" (each sample: {burst} consecutive steps, per step)"
    print_table(f"{title} on {device.type}: median of n timed steps{where}", columns, rows, numeric)


def find(records: list[dict], section: str, method: str) -> Optional[dict]:
    rec = next((r for r in records if r["section"] == section and r["method"] == method), None)
    return rec if rec is not None and rec["available"] else None


def evaluate_targets(records: list[dict], device: torch.device, skipped: dict[str, str]) -> list[dict]:
    """The project's targets from the measured records. PASS/FAIL; INFO where the target is for the other
    device; N/A where the section or the anchor could not be measured."""
    targets: list[dict] = []

    def missing(section: str) -> str:
        if section in skipped:
            return f"section skipped: {skipped[section]}"
        return "not measured" if any(r["section"] == section for r in records) else "section not run"

    def add(target: str, section: str, value: Optional[float], fmt: str, threshold: str, ok: Optional[bool],
            applies: bool, na: str = "") -> None:
        if value is None:
            verdict, measured = "N/A", na or "not measured"
        else:
            verdict = ("PASS" if ok else "FAIL") if applies else "INFO"
            measured = fmt.format(value)
        targets.append({"target": target, "section": section, "measured": measured, "threshold": threshold,
                        "verdict": verdict, "value": value})

    def add_goal(label: str, section: str, value: Optional[float], fmt: str, na: str) -> None:
        g = goal(NAME, label)
        add(g.title, section, value, fmt, g.text(), g.met(value), g.applies(device), na)

    def speedup(section: str, ours: str, anchor: str) -> tuple[Optional[float], str]:
        rec = find(records, section, ours)
        anchor_rec = next((r for r in records if r["section"] == section and r["anchor"] == anchor), None)
        if rec is None or anchor_rec is None:
            return None, missing(section)
        if not anchor_rec["available"]:
            return None, f"{anchor} n/a: {anchor_rec['na_reason']}"
        return rec["speedup_vs"].get(anchor), ""

    x, na = speedup("adamw", OURS_ADAMW, ANCHOR_FUSED)
    add_goal("(a)", "adamw", x, "{:.2f}x", na)
    for key in LOW_PRECISION:
        x, na = speedup(key, OURS_O2, ANCHOR_O2)
        add_goal("(b)", key, x, "{:.2f}x", na)
    for key, ours in (("adamw", OURS_ADAMW), ("adam", OURS_ADAM), ("sgd", OURS_SGD), ("lamb", OURS_LAMB),
                      ("lion", OURS_LION), ("o2-fp16", OURS_O2), ("o2-bf16", OURS_O2)):
        rec = find(records, key, ours)
        add_goal("(c)", key, rec["pct_copy_roof"] if rec else None, "{:.1f}%", missing(key))
    for key in LOW_PRECISION:
        x, na = speedup(key, OURS_O2, ANCHOR_O2)
        add_goal("(d)", key, x, "{:.2f}x", na)
        x, na = speedup(key, OURS_O2, ANCHOR_APEX)
        add_goal("(e)", key, x, "{:.2f}x", na)
    x, na = speedup("lamb", OURS_LAMB, ANCHOR_LOOP)
    add_goal("(g)", "lamb", x, "{:.2f}x", na)
    x, na = speedup("lion", OURS_LION, ANCHOR_FOREACH)
    add_goal("(h)", "lion", x, "{:.2f}x", na)
    for key in LOW_PRECISION:
        with_write, without = find(records, key, OURS_O2_STEP), find(records, key, OURS_O2_NO_WRITE)
        cost = None if with_write is None or without is None else \
            with_write["timing"]["median_s"] / without["timing"]["median_s"] - 1.0
        add("cost of leaving p.grad unscaled: step() with grad_scale vs on unscaled grads", key,
            None if cost is None else 100.0 * cost, "{:+.1f}% time", "2 of 30 B/param: ~+7%", True, False,
            missing(key))
    for key, sr_name, nearest_name in [(k, OURS_SR, OURS_NEAREST) for k in SR_SECTIONS] + [
            ("overhead", OVERHEAD_SR, OVERHEAD_NEAREST)]:
        sr, nearest = find(records, key, sr_name), find(records, key, nearest_name)
        ratio = None if sr is None or nearest is None else sr["timing"]["median_s"] / nearest["timing"]["median_s"]
        add_goal("(i)", key, ratio, "{:.3f}", missing(key))
    for key in ("overhead", OVERHEAD_ONE, OVERHEAD_ONE_LR):
        x, na = speedup(key, OVERHEAD_OURS, ANCHOR_FUSED)
        add_goal("(j)", key, x, "{:.2f}x", na)
    x, na = speedup("adamw", OURS_ADAMW, ANCHOR_DEEPSPEED)
    add_goal("(k)", "adamw", x, "{:.2f}x", na)
    for key in SR_SECTIONS:
        x, na = speedup(key, OURS_NEAREST, ANCHOR_DEEPSPEED)
        add_goal("(l)", key, x, "{:.2f}x", na)
    x, na = speedup(SR_TORCHAO, OURS_SR, ANCHOR_TORCHAO)
    add_goal("(m)", SR_TORCHAO, x, "{:.2f}x", na)
    rem, masters = find(records, "remainder", OURS_REMAINDER), find(records, "remainder", OURS_MASTERS)
    add("remainder step time / FP32-master step time (BF16 AdamW)", "remainder",
        None if rem is None or masters is None else rem["timing"]["median_s"] / masters["timing"]["median_s"],
        "{:.3f}", "26 vs 28 B/param: ~0.93", True, False, missing("remainder"))
    for key, ours in (("adamw", OURS_ADAMW), ("adam", OURS_ADAM), ("sgd", OURS_SGD), ("o2-fp16", OURS_O2_STEP),
                      ("o2-bf16", OURS_O2_STEP)):
        rec = find(records, key, ours)
        kernels = rec["kernels_per_step"] if rec else None
        add_goal("(f)", key, None if kernels is None else float(kernels), "{:.0f}",
                 "CUDA only" if device.type != "cuda" else missing(key))
    return targets


def print_targets(targets: list[dict], quick: bool, busy: Optional[float]) -> None:
    rows = [[t["target"], t["section"], t["measured"], t["threshold"], t["verdict"]] for t in targets]
    print_table("Project targets", ["target", "section", "measured", "target value", "verdict"], rows,
                [False, False, True, False, False])
    decided = [t for t in targets if t["verdict"] in ("PASS", "FAIL")]
    passed = sum(t["verdict"] == "PASS" for t in decided)
    print_text(f"targets: {passed}/{len(decided)} PASS (INFO: a target for the other device; N/A: not measurable "
               "in this run)")
    if busy is not None and busy > 0.1:
        print_text(f"  NOTE: other processes kept up to {busy:.0%} of the cpus busy around this run. torch's CPU "
                   "optimizers run one parallel region per tensor (hundreds per step) and each one waits for a "
                   "descheduled thread, where ours runs one per step: on a busy machine the speedups vs torch "
                   "can be many times those of an idle one. Rerun on an idle machine before trusting the verdicts.")
    if quick:
        print_text("--quick: on a list this small, per-step host costs weigh more than at the default size, which "
                   "the targets are meant for")


def print_checks(records: list[dict]) -> bool:
    """Prints the end-of-run checks (finite values, flags still 0, steps not skipped); True when all hold."""
    ok = True
    for r in records:
        if not r["available"]:
            continue
        problems = []
        if not r["finite_after"]:
            problems.append("non-finite params or masters")
        if any(f != 0.0 for f in r["found_inf_after"]):
            problems.append(f"found_inf set {r['found_inf_after']}")
        if r["steps_match_calls"] is False:
            problems.append(f"step count {r['step_count']} != {r['calls']} calls (steps were skipped)")
        if r.get("check_after"):
            problems.append(r["check_after"])
        if problems:
            ok = False
            print_text(f"  CHECK FAILED [{r['section']}] {r['method']}: {'; '.join(problems)}")
    if ok:
        print_text("checks after the run: every param and master finite, found_inf still 0, step counts equal to the "
                   "calls made (no step skipped), each section's own checks (follow: the masters within the clamp)")
    return ok


def main() -> None:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--params", type=parse_count, default=None,
                        help=f"params in the list, e.g. 50M, 200M, 1B (default {DEFAULT_PARAMS['cpu'] / 1e6:.0f}M on "
                             f"the CPU, {DEFAULT_PARAMS['cuda'] / 1e6:.0f}M on CUDA, {QUICK_PARAMS / 1e6:.0f}M with "
                             "--quick)")
    parser.add_argument("--tensors", type=positive_int, default=DEFAULT_TENSORS,
                        help=f"tensors in the list (default {DEFAULT_TENSORS})")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="sections to run (default: all)")
    args = parse_args(parser, repeats={"cpu": 10, "cuda": 50}, warmup={"cpu": 1, "cuda": 5})
    device: torch.device = args.device
    total = args.params or (QUICK_PARAMS if args.quick else DEFAULT_PARAMS[device.type])
    sizes = sizes_or_error(parser, args.tensors, total, "--tensors/--params")

    machine = machine_info(device)
    roofs = measure_roofs(device, warmup=max(1, args.warmup), repeats=max(5, args.repeats))
    print_header(NAME, machine, roofs)
    print_text(f"list: {len(sizes)} tensors, {total / 1e6:.1f}M params (largest {max(sizes):,}, median "
               f"{sorted(sizes)[len(sizes) // 2]:,}, smallest {min(sizes):,}); {args.warmup} warm-up + up to "
               f"{args.repeats} timed steps per method, at most ~{args.max_seconds:g} s each (at least 3 steps)")
    apex_reason = apex_importable()
    print_text(f"apex: not importable ({apex_reason})" if apex_reason else "apex: importable")
    anchor_packages = {name: installed_version(name) for name in ("deepspeed", "torchao")}
    print_text("other anchors: " + ", ".join(f"{name} {version}" for name, version in anchor_packages.items()))
    if device.type == "cpu":
        print_text("  on the CPU the copy roof counts y.copy_(x) as read + write, without the read of y that "
                   "write-allocate adds; in-place updates (read-modify-write) can therefore exceed 100%")
    check_agreement(device)
    print_text("agreement check: FusedAdamW/FusedAdam/FusedSGD match torch's for-loop optimizers after two steps "
               "(FP32 and O2 FP16 masters)")

    probe = RoofProbe(device)
    records: list[dict] = []
    roofs_by_section: dict[str, Roofs] = {}
    skipped: dict[str, str] = {}
    sections_meta: dict[str, tuple[list[str], str, str, list[str]]] = {}
    for key in args.sections:
        free_memory(device)
        why = torchao_importable() if key == SR_TORCHAO else ""
        if why:
            skipped[key] = f"torchao not importable ({why}): pip install torchao"
            print_text(f"[{key}] skipped: {skipped[key]}")
            continue
        need = bytes_needed(key, total, with_apex=not apex_reason and device.type == "cuda")
        have = memory_available(device)
        if have is not None and need > 0.9 * have:
            skipped[key] = f"needs ~{need / GB:.1f} GB, {have / GB:.1f} GB available"
            print_text(f"[{key}] skipped: {skipped[key]}")
            continue
        if key in ("adamw", "adam", "sgd"):
            section = fp32_section(key, sizes, device)
        elif key in ("lamb", "lion"):
            section = lamb_lion_section(key, sizes, device)
        elif key in LOW_PRECISION:
            section = o2_section(key, sizes, device)
        elif key in SR_SECTIONS or key == "remainder":
            section = precision_section(key, sizes, device)
        elif key == SR_TORCHAO:
            section = torchao_section(total, device)
        elif key == "follow":
            section = follow_section(sizes, device)
        elif key == "overhead":
            section = overhead_section(device)
        else:
            section = overhead_one_section(device, new_lr=key == OVERHEAD_ONE_LR)
        roofs_by_section[key], of_section = measure_section(section, args, probe)
        records += of_section
        sections_meta[key] = (section.anchors, section.title, section.model, section.notes)
        del section, of_section
    del probe
    free_memory(device)
    machine["cpu_busy_after_run"] = cpu_busy_fraction()
    warn_if_busy(machine["cpu_busy_after_run"], "just after this run")

    for key, (anchors, title, model, notes) in sections_meta.items():
        of_section = [r for r in records if r["section"] == key]
        print_section(of_section, roofs_by_section[key], device, anchors, title, model)
        for note in notes:
            print_text(f"  {note}")
        warn_if_busy(of_section[0]["others_busy_during_section"], "while this section was timed")
    checks_ok = print_checks(records)
    ours_fp32 = find(records, "adamw", OURS_ADAMW)
    overhead = find(records, "overhead", OVERHEAD_OURS)
    if ours_fp32 and overhead:
        share = overhead["timing"]["median_s"] / ours_fp32["timing"]["median_s"]
        print_text(f"host overhead of FusedAdamW.step() with {OVERHEAD_TENSORS} tensors: "
                   f"{overhead['timing']['median_s'] * 1e3:.2f} ms, {share:.1%} of the FP32 AdamW step at "
                   f"{total / 1e6:.0f}M params")
    targets = evaluate_targets(records, device, skipped)
    busy = max((b for b in [machine["cpu_busy_before_run"], machine["cpu_busy_after_run"]]
                 + [r["others_busy_during_section"] for r in records] if b is not None), default=None)
    print_targets(targets, args.quick, busy if device.type == "cpu" else None)

    out: Optional[Path] = json_path(args, NAME)
    if out is not None:
        config = {"tensors": len(sizes), "params": total, "sizes": sizes, "seed": SEED, "loss_scale": LOSS_SCALE,
                  "grad_std": GRAD_STD, "lr": LR, "betas": list(BETAS), "eps": EPS, "adamw_weight_decay": WEIGHT_DECAY,
                  "sgd_momentum": MOMENTUM, "sections": args.sections, "skipped_sections": skipped,
                  "quick": args.quick, "warmup": args.warmup, "max_repeats": args.repeats,
                  "max_seconds": args.max_seconds, "apex": apex_reason or "importable", **anchor_packages,
                  "traffic_model_bytes_per_param": {"fp32_adam": BYTES_FP32_ADAM, "fp32_sgd": BYTES_FP32_SGD,
                                                    "fp32_lamb": BYTES_FP32_LAMB, "fp32_lion": BYTES_FP32_LION,
                                                    "o2_adamw": BYTES_O2, "o2_adamw_step_only": BYTES_O2_STEP,
                                                    "o2_adamw_no_grad_write": BYTES_O2_STEP_NO_WRITE,
                                                    "torch_o2_pipeline_actual": BYTES_TORCH_O2_ACTUAL,
                                                    "lowp_no_master": BYTES_LOWP_NO_MASTER,
                                                    "remainder": BYTES_REMAINDER,
                                                    "fp32_masters_no_unscale": BYTES_MASTERS_NO_UNSCALE,
                                                    "follow_clamp_step": BYTES_FOLLOW}}
        write_json(out, machine, roofs, records, config=config, targets=targets, checks_ok=checks_ok,
                   roofs_interleaved={k: r.to_dict() for k, r in roofs_by_section.items()})
        print_text(f"wrote {out}")
    if not checks_ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
