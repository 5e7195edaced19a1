"""The launch plumbing a first GPU run meets: lists split over several launches, grids of 10,000+ blocks,
misaligned starts, big and batched GEMM grids, two streams at once, a second GPU, and the counters the
last-block reductions borrow. The cases that are not CUDA-specific run on the CPU too (its kernels split
lists and take vector paths of their own); the rest are skipped without a GPU, with the reason."""

import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import mpfused
from mpfused import _ops
from mpfused.optim import FusedAdamW
from conftest import requires_cuda
from optim_helpers import bits
from tolerances import NORM_ULP, OPTIM_FP32_ATOL, SUMSQ_RTOL

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def flag(device, value=0.0):
    return torch.full((1,), value, dtype=torch.float32, device=device)


def ref_sumsq(tensors, inv_scale=1.0):
    return sum(float((t.double() * inv_scale).square().sum()) for t in tensors)


def check(tensors, device, inv=None, unscale=False):
    """found_inf, sumsq and norm of one overwrite-mode call (the scaler's), as Python floats."""
    found, sumsq, norm = (torch.empty(1, device=device) for _ in range(3))
    _ops.non_finite_check_(tensors, found, inv, unscale=unscale, sumsq=sumsq, overwrite=True, norm=norm,
                           counter=_ops.borrowed_counter({}, torch.device(device)))
    return found.item(), sumsq.item(), norm.item()


# ---- long lists: more tensors than one launch holds -----------------------------------------------------
@pytest.mark.sanitize
def test_more_than_1024_grads_in_one_check(device):
    """2,500 tensors of mixed dtypes and sizes (3 launches on CUDA: 1,024 per launch): the flag, the sum of
    squares and the unscale cover every tensor; an inf in the very last one is found."""
    gen = torch.Generator().manual_seed(7)
    tensors = [(torch.randn(1 + (i * 37) % 3000, generator=gen) * 64).to(DTYPES[i % 3]).to(device) for i in range(2500)]
    assert _ops.overflow_planned_launches([t.numel() for t in tensors], "cuda") == 3
    expected = [(t.float() * 2.0**-6).to(t.dtype) for t in tensors]
    inv = torch.tensor([2.0**-6], device=device)
    found, sumsq, norm = check(tensors, device, inv, unscale=True)
    assert found == 0.0
    assert sumsq == pytest.approx(ref_sumsq(expected), rel=SUMSQ_RTOL[torch.float32])
    assert abs(norm - sumsq**0.5) <= NORM_ULP * float(np.spacing(np.float32(norm)))
    for t, e in zip(tensors, expected):
        assert torch.equal(bits(t), bits(e))
    tensors[-1][-1] = float("inf")
    assert check(tensors, device)[0] == 1.0
    tensors[-1][-1] = 0.0
    tensors[1030][0] = float("nan")  # in the second launch
    assert check(tensors, device)[0] == 1.0


@pytest.mark.sanitize
def test_more_than_384_params_in_one_step(device):
    """A FusedAdamW group of 900 params (3 launches on CUDA: 384 per launch) with weight decay, 5 steps:
    every param follows torch's AdamW, and every step count is 5."""
    gen = torch.Generator().manual_seed(8)
    init = [torch.randn(1 + (i * 53) % 2000, generator=gen) for i in range(900)]
    grads = [[torch.randn(t.shape, generator=gen) for t in init] for _ in range(5)]
    ours = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    ref = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in grads:
        for p, q, g in zip(ours, ref, step):
            p.grad, q.grad = g.to(device), g.to(device)
        opt.step()
        opt_ref.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=0, atol=OPTIM_FP32_ATOL)
    assert {float(opt.state[p]["step"]) for p in ours} == {5.0}


# ---- misaligned starts: storage offsets of 1 to 7 elements ----------------------------------------------
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", range(1, 8))
def test_storage_offsets_give_the_bits_of_aligned_tensors(device, dtype, offset):
    """Tensors that start 1-7 elements into their storage (the 16-byte vector loads cannot be used from
    the start) give the flag and the unscaled bits of aligned copies of the same values, and their sum of
    squares within the FP32 accumulation bound (the lanes add in another order than on aligned data)."""
    gen = torch.Generator().manual_seed(offset)
    n = 70_000 + offset  # more than one chunk, with a ragged end
    base = (torch.randn(n + 8, generator=gen) * 8).to(dtype).to(device)
    view = base[offset:offset + n]
    assert view.storage_offset() == offset and view.is_contiguous()
    aligned, head = view.clone(), base[:offset].clone()
    inv = torch.tensor([0.125], device=device)
    expected = ref_sumsq([view, head], 0.125)
    found, sumsq, _ = check([view, base[:offset]], device, inv, unscale=True)
    found_aligned, sumsq_aligned, _ = check([aligned, head], device, inv, unscale=True)
    assert found == found_aligned == 0.0
    assert sumsq == pytest.approx(expected, rel=SUMSQ_RTOL[dtype])
    assert sumsq_aligned == pytest.approx(expected, rel=SUMSQ_RTOL[dtype])
    assert torch.equal(bits(view), bits(aligned)) and torch.equal(bits(base[:offset]), bits(head))
    view[n // 2] = float("nan")
    assert check([view], device)[0] == 1.0


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("offset", range(1, 8))
def test_optimizer_on_misaligned_params_and_grads_gives_the_aligned_bits(device, dtype, offset):
    """FP16/BF16 params and grads at storage offsets 1-7 (each misaligned differently), with FP32 masters:
    three steps give the bits of the same steps on aligned copies."""
    gen = torch.Generator().manual_seed(10 + offset)
    n = 70_001
    pbase = torch.randn(n + 8, generator=gen).to(dtype).to(device)
    gbase = torch.randn(n + 8, generator=gen).to(dtype).to(device)
    goff = 7 - offset + 1  # the grad's misalignment differs from the param's
    p_view = torch.nn.Parameter(pbase[offset:offset + n])
    p_aligned = torch.nn.Parameter(pbase[offset:offset + n].clone())
    assert p_view.storage_offset() == offset
    runs = []
    for p, grad in ((p_view, gbase[goff:goff + n]), (p_aligned, gbase[goff:goff + n].clone())):
        opt = FusedAdamW([p], lr=1e-2, weight_decay=0.1, master_weights=True)
        for _ in range(3):
            p.grad = grad
            opt.step()
        runs.append((bits(p), bits(opt.state[p]["master_param"]), bits(opt.state[p]["exp_avg_sq"])))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ---- GEMM grids -----------------------------------------------------------------------------------------
def small_ints(shape, dtype, device, gen):
    """|values| <= 3: every product and partial sum is exact in FP32 for K below 2^20."""
    return torch.randint(-3, 4, shape, generator=gen).to(dtype).to(device)


def operand(rows, cols, batch, transposed, dtype, device, gen):
    lead = () if batch is None else (batch,)
    if transposed:
        return small_ints(lead + (cols, rows), dtype, device, gen).transpose(-1, -2)
    return small_ints(lead + (rows, cols), dtype, device, gen)


LAYOUTS = {"nn": (False, False), "tn": (True, False), "nt": (False, True), "tt": (True, True)}


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("m,n,k,batch", [(1100, 72, 47, None), (1153, 130, 95, 2), (8, 8, 13, 65_537),
                                         (5, 3, 33, 70_001)],
                         ids=["m1100-k47", "m1153-k95-batch2", "batch65537-k13", "batch70001-k33"])
def test_gemm_every_layout_k_not_a_multiple_of_32_tall_and_huge_batches(device, dtype, layout, m, n, k, batch):
    """Every operand layout with K % 32 != 0 (a partial last K tile), M >= 1,100 (more row tiles than one
    swizzle group), and batches past 65,535 (the grid's y limit: batches beyond it loop): exact on small
    integers, FP32 output, against float64."""
    ta, tb = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(m + n + k)
    a = operand(m, k, batch, ta, dtype, device, gen)
    b = operand(k, n, batch, tb, dtype, device, gen)
    out = mpfused.gemm(a, b, out_dtype=torch.float32)
    expected = torch.matmul(a.double().cpu(), b.double().cpu()).float()
    assert out.shape == expected.shape
    assert torch.equal(out.cpu(), expected)


# ---- CUDA: the last-block reduction over 10,000+ blocks -------------------------------------------------
@pytest.mark.cuda
@pytest.mark.big
@requires_cuda
def test_sum_of_squares_over_10000_blocks_is_bitwise_repeatable():
    """One launch of 10,240 blocks (1,024 tensors of 10 chunks): the last block adds 10,240 partials in a
    fixed order, so five calls give the same bits, and the sum is the float64 one within the FP32 bound."""
    chunk = _ops.overflow_limits("cuda")["chunk_size"]
    need = 1024 * 10 * chunk * 2
    free, _ = torch.cuda.mem_get_info()
    if free < 2 * need:
        pytest.skip(f"needs {2 * need / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    g = torch.Generator(device="cuda").manual_seed(3)
    tensors = [torch.randn(10 * chunk, device="cuda", generator=g).to(torch.bfloat16 if i % 2 else torch.float16)
               for i in range(1024)]
    assert _ops.overflow_planned_launches([t.numel() for t in tensors], "cuda") == 1
    results = []
    for _ in range(5):
        found, sumsq, norm = (torch.empty(1, device="cuda") for _ in range(3))
        mpfused.non_finite_check_(tensors, found, sumsq=sumsq, overwrite=True, norm=norm)
        results.append(torch.cat([found, sumsq, norm]))
    for r in results[1:]:
        assert torch.equal(bits(r), bits(results[0]))
    assert results[0][0].item() == 0.0
    assert results[0][1].item() == pytest.approx(ref_sumsq(tensors), rel=SUMSQ_RTOL[torch.float16])


# ---- CUDA: streams, graph capture and the borrowed counters ---------------------------------------------
@pytest.mark.sanitize
@pytest.mark.cuda
@requires_cuda
def test_counters_are_per_stream_and_none_while_capturing():
    store = {}
    dev = torch.device("cuda", torch.cuda.current_device())
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        c1 = _ops.borrowed_counter(store, dev)
        assert _ops.borrowed_counter(store, dev) is c1
    with torch.cuda.stream(s2):
        c2 = _ops.borrowed_counter(store, dev)
    assert c1 is not c2 and c1.data_ptr() != c2.data_ptr()
    assert _ops.borrowed_counter(store, torch.device("cpu")) is None
    assert _ops.borrowed_counter(store, torch.device("cuda")) is _ops.borrowed_counter(store, dev)  # index filled in
    graph = torch.cuda.CUDAGraph()
    x, y = torch.ones(10, device="cuda"), torch.zeros(10, device="cuda")
    # nothing is allocated in the capture: the sanitizer stage runs without torch's caching allocator, whose
    # absence makes an allocation during a capture fail
    with torch.cuda.graph(graph):
        assert _ops.borrowed_counter(store, dev) is None
        torch.mul(x, 2, out=y)
    graph.replay()
    assert len(store) == 3 and torch.equal(y, x * 2)


@pytest.mark.sanitize
@pytest.mark.cuda
@requires_cuda
def test_two_streams_at_once_give_the_single_stream_results():
    """Two streams held back by a spin kernel each while 40 checks (overwrite mode, sum of squares and norm)
    are queued on each, so that the two queues then run at the same time, with counters from one store
    (one per stream); then one optimizer stepped from both streams at once (its params in two halves, each
    half's grads set on its own stream): every result has the bits of the same work on one stream."""
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cuda").manual_seed(4)
    lists = [[torch.randn(100_000 + 997 * i, device="cuda", generator=g).half() for i in range(40)] for _ in range(2)]
    for t in lists[1][::7]:
        t[5] = float("inf")

    def fresh():
        return [tuple(torch.empty(1, device="cuda") for _ in range(3)) for _ in range(40)]

    def check_call(which, i, out, store):
        found, sumsq, norm = out[i]
        tensors = lists[which][i:] + lists[which][:i]
        _ops.non_finite_check_(tensors, found, sumsq=sumsq, overwrite=True, norm=norm,
                               counter=_ops.borrowed_counter(store, dev))

    serial, store = [fresh(), fresh()], {}
    for which in (0, 1):
        for i in range(40):
            check_call(which, i, serial[which], store)
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    concurrent, store = [fresh(), fresh()], {}
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.cuda._sleep(100_000_000)  # tens of ms: both queues fill before either runs
    for i in range(40):
        for which, s in enumerate(streams):
            with torch.cuda.stream(s):
                check_call(which, i, concurrent[which], store)
    torch.cuda.synchronize()
    assert len(store) == 2
    for which in (0, 1):
        for a, b in zip(serial[which], concurrent[which]):
            assert torch.equal(bits(torch.cat(a)), bits(torch.cat(b)))

    init = [torch.randn(50_000 + i, device="cuda", generator=g) for i in range(60)]
    grads = [torch.randn_like(t) for t in init]

    def half_step(opt, params, which):
        for i, p in enumerate(params):
            p.grad = grads[i] if i % 2 == which else None
        opt.step()

    alone = [torch.nn.Parameter(t.clone()) for t in init]
    opt_alone = FusedAdamW(alone, lr=1e-3)
    for _ in range(20):
        for which in (0, 1):
            half_step(opt_alone, alone, which)
    shared = [torch.nn.Parameter(t.clone()) for t in init]
    opt = FusedAdamW(shared, lr=1e-3)
    torch.cuda.synchronize()
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(20):
        for which, s in enumerate(streams):
            with torch.cuda.stream(s):
                torch.cuda._sleep(2_000_000)  # about a millisecond: the other stream's step is queued meanwhile
                half_step(opt, shared, which)
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert len(opt.__dict__["_mpf_counters"]) == 2
    for p, q in zip(shared, alone):
        assert torch.equal(bits(p), bits(q))
    assert {float(opt.state[p]["step"]) for p in shared} == {20.0}


@pytest.mark.cuda
@pytest.mark.trap
@requires_cuda
def test_a_shared_counter_traps_instead_of_returning_a_wrong_sum():
    """A counter that is not zero when a launch starts (as one shared with a concurrent launch would be)
    makes the kernel trap: the launch fails with a CUDA error, never a silently wrong sum. In a child
    process: a trap leaves the CUDA context unusable."""
    code = textwrap.dedent("""
        import torch, mpfused
        from mpfused import _ops
        t = [torch.ones(5 * 65536, device="cuda")]
        found, sumsq, norm = (torch.empty(1, device="cuda") for _ in range(3))
        counter = torch.full((1,), 1000, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        print("launching", flush=True)
        _ops.non_finite_check_(t, found, sumsq=sumsq, overwrite=True, norm=norm, counter=counter)
        print("launched", flush=True)
        torch.cuda.synchronize()
        print("no error: sumsq", sumsq.item())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "launching" in r.stdout, r.stderr[-2000:]  # the child had a working GPU up to the launch
    assert r.returncode != 0 and "no error" not in r.stdout, r.stdout
    # a trap is reported as a launch failure or an illegal instruction, at the launch check or the sync
    assert re.search(r"launch failure|illegal instruction", r.stderr, re.I), r.stderr[-2000:]


# ---- CUDA: a second GPU ---------------------------------------------------------------------------------
@pytest.mark.cuda
@requires_cuda
def test_tensors_on_cuda_1_while_cuda_0_is_current():
    """With cuda:0 current, the check, an optimizer step with the scaler, and the GEMM on tensors on
    cuda:1 run on cuda:1 and give the bits they give on cuda:0."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs, this machine has {torch.cuda.device_count()}")
    torch.cuda.set_device(0)

    def run(device):
        gen = torch.Generator().manual_seed(9)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(device)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        opt = FusedAdamW(model.parameters(), lr=1e-3)
        scaler = mpfused.GradScaler("cuda", init_scale=2.0**10)
        x = torch.randn(32, 64, generator=gen).to(device)
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(model(x).square().mean()).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        a = torch.randint(-3, 4, (300, 47), generator=gen).half().to(device)
        out = mpfused.gemm(a, a.t(), out_dtype=torch.float32)
        assert out.device == torch.device(device)
        return [bits(p) for p in model.parameters()] + [bits(out), bits(scaler.get_scale() * torch.ones(1))]

    for a, b in zip(run("cuda:0"), run("cuda:1")):
        assert torch.equal(a, b)
