"""`torchrun --nproc_per_node 2 examples/fsdp2_transformer.py`: FSDP2 training with mpfused's fused
optimizer and GradScaler, one forced overflow that every rank skips together, and a bit-exact resume from a
torch.distributed.checkpoint (DCP) checkpoint.

A small decoder-only transformer (token and position embeddings, pre-LayerNorm blocks with causal
self-attention and a GELU MLP, a final LayerNorm and an output head) learns a copy task: each sequence is
a random half followed by the same half again, and the loss is taken on the second half only. An untrained
model scores about ln(vocab) there; once attention learns to look back half a sequence the loss falls to
near zero. Every block is ``fully_shard``-ed, then the root, on a 1-D DeviceMesh over all ranks; each rank
draws its own batches (data parallel), reproducible from ``--seed``, the step and the rank.

mpfused's part:

- ``mpfused.optim.FusedAdamW`` takes the DTensor params that ``fully_shard`` makes and updates each rank's
  local shards in one fused pass; its state tensors (exp_avg, exp_avg_sq) are DTensors with the params'
  placements;
- ``mpfused.GradScaler(device, device_mesh=mesh)`` checks the local gradient shards for inf/NaN, all-reduces
  found_inf (MAX) over the mesh, and ``clip_grad_norm_`` returns the global gradient norm (squares summed
  over the sharded mesh dim) and clips inside the fused step;
- at ``--overflow-at`` rank 0 writes an inf into one element of its own gradient shard, after the
  reduce-scatter, so only rank 0 sees it: every rank skips that step and halves the scale all the same.

``--param-dtype bf16`` (the default on CUDA) passes ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)`` to ``fully_shard``: the forward and backward run in BF16 on all-gathered BF16
params, the gradients are reduced in FP32, and the sharded params, gradients and optimizer state stay FP32.
``fp32`` (the default on the CPU, where this tiny model trains faster in FP32) casts nothing.

At ``--save-at`` the model, optimizer and scaler are saved with ``dcp.save`` (``get_state_dict`` for the
model and optimizer, ``scaler.state_dict()`` for the scaler). After the last step, a fresh model, optimizer
and scaler (the model built from another seed) load that checkpoint (``dcp.load``, ``set_state_dict``,
``scaler.load_state_dict``), re-run the steps after ``--save-at`` on the same batches, and are compared with
the unbroken run: the losses of every re-run step, the params and the optimizer state, on every rank. With
the same world size they must agree bit for bit; the script exits with status 1 when they do not.

Rank 0 prints one row every ``--log-every`` steps (and for the overflow step and the one before it): the
mean loss over the ranks, the global gradient norm, the loss scale and the skipped-step count (host reads
made only for the printed rows). Backend: nccl with one GPU per rank when CUDA is available, gloo on the
CPU. Run from the repository root with mpfused importable (``PYTHONPATH=.`` for the in-place build). The
default checkpoint directory is a temporary one on rank 0's machine (removed at the end): with more than
one machine pass a shared ``--checkpoint-dir``.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import mpfused
from mpfused.optim import FusedAdamW

VOCAB, D_MODEL, HEADS, LAYERS, SEQ = 64, 64, 4, 2, 32


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal multi-head self-attention, then a GELU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv, self.proj = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
        self.fc1, self.fc2 = nn.Linear(D_MODEL, 4 * D_MODEL), nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits, one row per token: (batch * seq, vocab)."""
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h).flatten(0, 1))  # 2-D: not a view, as FSDP2 wants of a module's output


def build(args, mesh, device: torch.device, seed: int):
    """The FSDP2 model (every block sharded, then the root), FusedAdamW and the mesh-wide scaler."""
    torch.manual_seed(seed)  # the same init on every rank: fully_shard keeps each rank's slice of it
    model = Transformer().to(device)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if args.param_dtype == "bf16" else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = FusedAdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scaler = mpfused.GradScaler(device.type, init_scale=2.0**10, growth_interval=args.growth_interval,
                                device_mesh=mesh)
    return model, opt, scaler


def batch(args, step: int, rank: int, device: torch.device):
    """This rank's batch for ``step``: (inputs, targets), the targets of the second half only (-100
    elsewhere, ignored by the loss). A function of (seed, step, rank) alone, so a resumed run sees the same."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1_009 + rank)
    half = torch.randint(0, VOCAB, (args.batch, SEQ // 2), generator=g)
    seq = torch.cat([half, half, half[:, :1]], dim=1)  # SEQ + 1 tokens: inputs seq[:-1], targets seq[1:]
    inputs, targets = seq[:, :-1], seq[:, 1:].clone()
    targets[:, : SEQ // 2 - 1] = -100  # predicting the random first half is impossible: not scored
    return inputs.to(device), targets.to(device)


def train(args, model, opt, scaler, first: int, last: int, rank: int, device, log=None, save_to=None):
    """Steps first..last (1-based), with a checkpoint in ``save_to`` after step ``args.save_at`` when given;
    returns this rank's loss per step (0-d tensors, no host read)."""
    losses = {}
    for step in range(first, last + 1):
        inputs, targets = batch(args, step, rank, device)
        opt.zero_grad()
        loss = F.cross_entropy(model(inputs).float(), targets.flatten())
        scaler.scale(loss).backward()
        if step == args.overflow_at and rank == 0:
            with torch.no_grad():  # rank 0 alone: one element of its shard of the first gradient
                next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
        norm = scaler.clip_grad_norm_(opt, args.max_norm)
        scaler.step(opt)
        scaler.update()
        losses[step] = loss.detach()
        if log is not None:
            log(step, loss, norm)
        if step == args.save_at and save_to is not None:
            save(save_to, model, opt, scaler, step)
    return losses


def save(path: str, model, opt, scaler, step: int) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "scaler": scaler.state_dict(), "step": step},
             checkpoint_id=path)


def load(path: str, model, opt, scaler) -> int:
    model_sd, optim_sd = get_state_dict(model, opt)  # the fresh objects' layout: dcp.load fills it in place
    state = {"model": model_sd, "optim": optim_sd, "scaler": scaler.state_dict(), "step": -1}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scaler.load_state_dict(state["scaler"])
    return int(state["step"])


def snapshot(model, opt) -> dict:
    """This rank's local shards of every param and every optimizer state tensor, copied."""
    out = {f"param {n}": p.detach().to_local().clone() for n, p in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                v = v.to_local() if hasattr(v, "to_local") else v
                out[f"{k} {names[p]}"] = v.detach().clone()
    return out


def mean_over_ranks(t: torch.Tensor, world: int) -> float:
    t = t.detach().float().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # gloo has no AVG
    return t.item() / world


def max_over_ranks(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--save-at", type=int, default=None, help="the step after which a DCP checkpoint is saved "
                   "(default: steps // 2); the steps after it are re-run from the checkpoint at the end")
    p.add_argument("--overflow-at", type=int, default=10, help="the step at which rank 0 writes an inf into its "
                   "gradient shard (0: none)")
    p.add_argument("--checkpoint-dir", default=None, help="where the checkpoint goes (default: a temporary "
                   "directory on rank 0's machine, removed at the end)")
    p.add_argument("--param-dtype", choices=("bf16", "fp32"), default=None,
                   help="FSDP2's compute dtype (MixedPrecisionPolicy param_dtype; reduce_dtype is fp32); "
                   "default bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--growth-interval", type=int, default=20)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be >= 2, got {args.steps}")
    if not 0 <= args.seed < 2**32:  # (seeds derived from it must stay in the generators' range)
        p.error(f"--seed must be in [0, 2**32), got {args.seed}")
    if args.save_at is None:
        args.save_at = args.steps // 2
    if not 1 <= args.save_at < args.steps:
        p.error(f"--save-at must lie in [1, steps - 1] = [1, {args.steps - 1}], got {args.save_at}")
    if not 0 <= args.overflow_at <= args.steps:
        p.error(f"--overflow-at must lie in [0, steps] = [0, {args.steps}], got {args.overflow_at}")
    if args.batch < 1 or args.log_every < 1 or args.growth_interval < 1:
        p.error("--batch, --log-every and --growth-interval must be >= 1")
    if args.param_dtype is None:
        args.param_dtype = "bf16" if torch.cuda.is_available() else "fp32"
    return args


def run(args) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))

    own_dir = args.checkpoint_dir is None
    if own_dir:  # rank 0 picks the directory; the others learn its name
        name = [tempfile.mkdtemp(prefix="mpfused_fsdp2_") if rank == 0 else None]
        dist.broadcast_object_list(name, src=0)
        args.checkpoint_dir = name[0]
    try:
        return run_in(args, rank, world, device, mesh)
    finally:
        if own_dir:
            dist.barrier()
            if rank == 0:
                shutil.rmtree(args.checkpoint_dir, ignore_errors=True)


def run_in(args, rank: int, world: int, device: torch.device, mesh) -> int:
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"FSDP2 on {world} ranks ({dist.get_backend()}, {device.type}), params {args.param_dtype} in compute "
        f"(FP32 shards, FP32 reduce), FusedAdamW, mpfused.GradScaler(device_mesh=mesh); {args.steps} steps, "
        f"checkpoint at step {args.save_at}, rank 0 overflows at step {args.overflow_at or 'none'}")
    say(f"copy task: vocab {VOCAB}, {SEQ} tokens, d_model {D_MODEL}, {LAYERS} blocks; untrained loss about "
        f"ln({VOCAB}) = {math.log(VOCAB):.3f}")
    model, opt, scaler = build(args, mesh, device, args.seed)
    show = {1, args.overflow_at - 1, args.overflow_at, args.steps} - {0}

    def log(step, loss, norm):  # the host reads (and the loss's all-reduce) only for the printed rows
        if step % args.log_every == 0 or step in show:
            say(f"{step:5d}  {mean_over_ranks(loss, world):8.4f}  {float(norm):10.4g}  {scaler.get_scale():8g}  "
                f"{scaler.skipped_steps:7d}")

    say(" step      loss   grad norm     scale  skipped")
    t0 = time.perf_counter()
    losses = train(args, model, opt, scaler, 1, args.steps, rank, device, log, save_to=args.checkpoint_dir)
    seconds = time.perf_counter() - t0
    reference = snapshot(model, opt)
    skipped = [None] * world
    dist.all_gather_object(skipped, scaler.skipped_steps)
    say(f"{args.steps} steps in {seconds:.2f} s; skipped steps on each rank: {skipped}; "
        f"final scale {scaler.get_scale():g}")

    # Resume: fresh objects (another init), the checkpoint, the same batches for the remaining steps.
    model2, opt2, scaler2 = build(args, mesh, device, args.seed + 1)
    step = load(args.checkpoint_dir, model2, opt2, scaler2)
    if step != args.save_at:
        raise RuntimeError(f"the checkpoint holds step {step}, expected {args.save_at}")
    losses2 = train(args, model2, opt2, scaler2, args.save_at + 1, args.steps, rank, device)
    resumed = snapshot(model2, opt2)

    def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0

    common = reference.keys() & resumed.keys()
    loss_diff = max(max_diff(losses[s], losses2[s]) for s in losses2)
    param_diff = max(max_diff(reference[k], resumed[k]) for k in common if k.startswith("param "))
    state_diff = max((max_diff(reference[k], resumed[k]) for k in common if not k.startswith("param ")), default=0.0)
    same_losses = all(torch.equal(losses[s], losses2[s]) for s in losses2)
    same_tensors = reference.keys() == resumed.keys() and all(torch.equal(reference[k], resumed[k]) for k in common)
    same_scaler = scaler.state_dict() == scaler2.state_dict()
    ok_here = same_losses and same_tensors and same_scaler
    ok = max_over_ranks(0.0 if ok_here else 1.0, device) == 0.0
    loss_diff = max_over_ranks(loss_diff, device)
    param_diff, state_diff = max_over_ranks(param_diff, device), max_over_ranks(state_diff, device)
    final, final2 = mean_over_ranks(losses[args.steps], world), mean_over_ranks(losses2[args.steps], world)
    say(f"resumed from the step-{args.save_at} checkpoint and re-ran steps {args.save_at + 1}..{args.steps}: "
        f"final loss {final2:.6f} vs {final:.6f} unbroken; max |loss diff| {loss_diff:g}, "
        f"max |param diff| {param_diff:g}, max |optimizer state diff| {state_diff:g}, "
        f"scaler state {'equal' if same_scaler else 'DIFFERENT'}")
    say(f"resume matches the unbroken run bit for bit: {ok}")
    return 0 if ok else 1


def main(argv=None) -> int:
    args = parse(argv)
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:  # (torch's own error: "environment variable RANK expected, but not set")
        sys.exit(f"run this with torchrun (e.g. torchrun --nproc-per-node 2 examples/fsdp2_transformer.py): "
                 f"{', '.join(missing)} not set")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend)
    try:
        return run(args)
    finally:
        # FSDP2's modules hold the process group in reference cycles: freed now, the group is destroyed here,
        # while Python is alive, and not at exit, where a gloo worker thread that still holds the tensors of
        # the last collective would abort the process (its decref cannot take the GIL any more).
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
