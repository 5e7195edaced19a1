"""mpfused.gemm against float64 and torch references: exact small-integer products, random-normal error
against torch's own FP32-accumulate error, every epilogue, operand layouts, and bad input."""

import itertools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import mpfused
from mpfused import _ops
from conftest import cuda_skip_reason, requires_cuda
from tolerances import GELU_TOL, GEMM_ACCUM_U, GEMM_ERROR_FACTOR, GEMM_OUT_HALF_ULP, GEMM_OUT_SUBNORMAL_HALF, LINEAR_REL_TOL

LOW = [torch.float16, torch.bfloat16]
OUT_DTYPES = [None, torch.float16, torch.bfloat16, torch.float32]
SIZES = [1, 7, 15, 16, 17, 31, 33, 100, 257]
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
# Batch modes: (batch of a, batch of b); None = a 2-D operand.
BATCH_MODES = [(None, None), (2, 2), (3, None), (None, 2)]


def _hopper_skip_reason(kernel):
    """Why the Hopper kernel (MPFUSED_GEMM_KERNEL=kernel: 'wgmma' or 'wgmma-cluster', set by the caller) cannot run
    here, or None."""
    if cuda_skip_reason() is not None:
        return cuda_skip_reason()
    index = torch.cuda.current_device()
    if _ops._C.gemm_cuda_kernel(index) == kernel:
        return None
    major, minor = torch.cuda.get_device_capability(index)
    return (f"the Hopper GEMM kernel needs a compute capability 9.0 GPU (this one is {major}.{minor}) and a build whose "
            f"TORCH_CUDA_ARCH_LIST names 9.0 (this one: {mpfused.build_info().get('cuda_arch_list')})")


@pytest.fixture(params=["cpu",
                        pytest.param("cuda", marks=pytest.mark.cuda),
                        pytest.param("cuda-wgmma", marks=[pytest.mark.cuda, pytest.mark.wgmma]),
                        pytest.param("cuda-wgmma-cluster", marks=[pytest.mark.cuda, pytest.mark.wgmma])])
def device(request, monkeypatch):
    """Every GEMM test on the CPU, on CUDA with the WMMA kernel, and on CUDA with the Hopper kernel, alone and in
    clusters of two CTAs (16-byte aligned operands on a compute capability 9.0 GPU; other operands take the WMMA
    kernel there too)."""
    if request.param == "cpu":
        return "cpu"
    if cuda_skip_reason() is not None:
        pytest.skip(cuda_skip_reason())
    if request.param.startswith("cuda-wgmma"):
        kernel = request.param[len("cuda-"):]
        monkeypatch.setenv("MPFUSED_GEMM_KERNEL", kernel)
        if _hopper_skip_reason(kernel) is not None:
            pytest.skip(_hopper_skip_reason(kernel))
    else:
        monkeypatch.delenv("MPFUSED_GEMM_KERNEL", raising=False)
    return "cuda"


def ints(shape, dtype, device, gen, lo=-3, hi=3):
    """Small integers: with |values| <= 3 and K <= 257 every product and partial sum is exact in FP32."""
    return torch.randint(lo, hi + 1, shape, generator=gen).to(dtype).to(device)


def operand(rows, cols, batch, transposed, make):
    """A (batch?, rows, cols) operand; transposed: a column-major view of a (cols, rows) tensor."""
    lead = () if batch is None else (batch,)
    if transposed:
        return make(lead + (cols, rows)).transpose(-1, -2)
    return make(lead + (rows, cols))


def assert_bitwise(actual, expected):
    """Same dtype, shape and bits (zeros compared by value: the sign of an exact zero depends on the
    order of the additions); NaN exactly where the reference has NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual.dtype, actual.shape,
                                                                               expected.dtype, expected.shape)
    actual, expected = actual.cpu(), expected.cpu()
    a_nan, e_nan = actual.isnan(), expected.isnan()
    assert torch.equal(a_nan, e_nan)
    view = INT_VIEW[actual.dtype]
    a, e = (actual[~a_nan] + 0.0).view(view), (expected[~e_nan] + 0.0).view(view)
    bad = (a != e).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} of {a.numel()} differ, first at flat index {bad[0].item()}"


def reference(a, b, out_dtype):
    return torch.matmul(a.double().cpu(), b.double().cpu()).to(out_dtype or a.dtype)


# ---- exact products ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["nn", "tn", "nt", "tt"])
def test_small_integers_are_exact_for_every_shape(device, dtype, ta, tb):
    """M, N, K in SIZES fully crossed; the out dtype and the batch mode rotate over the cross product, so
    each transpose pair sees every (out dtype, batch mode) combination on ~45 shapes."""
    gen = torch.Generator().manual_seed(1234 + 2 * ta + tb)
    make = lambda shape: ints(shape, dtype, device, gen)  # noqa: E731
    for idx, (m, n, k) in enumerate(itertools.product(SIZES, repeat=3)):
        out_dtype = OUT_DTYPES[idx % len(OUT_DTYPES)]
        batch_a, batch_b = BATCH_MODES[(idx // len(OUT_DTYPES)) % len(BATCH_MODES)]
        a = operand(m, k, batch_a, ta, make)
        b = operand(k, n, batch_b, tb, make)
        out = mpfused.gemm(a, b, out_dtype=out_dtype)
        assert_bitwise(out, reference(a, b, out_dtype))


def test_sums_past_the_low_precision_range_round_once(device):
    """Exact FP32 sums that FP16/BF16 cannot hold (2049, 257, ...) are rounded once, to nearest even."""
    k = 257
    for dtype in LOW:
        a = torch.ones(4, k, dtype=dtype, device=device)
        b = torch.ones(k, 3, dtype=dtype, device=device) * torch.tensor([8.0, 1.0, 3.0], dtype=dtype, device=device)
        for out_dtype in OUT_DTYPES:
            out = mpfused.gemm(a, b, out_dtype=out_dtype)
            assert_bitwise(out, reference(a, b, out_dtype))
        assert mpfused.gemm(a, b, out_dtype=torch.float32)[0].tolist() == [2056.0, 257.0, 771.0]


# ---- random normal inputs ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 48, 1024), (33, 17, 4096), (128, 130, 257)], ids=str)
def test_random_normal_error_within_the_accumulation_bound(device, dtype, out_dtype, shape):
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    a = torch.randn(m, k, generator=gen).to(dtype).to(device)
    b = torch.randn(n, k, generator=gen).to(dtype).to(device).t()  # a transposed view
    exact = torch.matmul(a.double().cpu(), b.double().cpu())
    torch_err = (torch.matmul(a.float(), b.float()).to(out_dtype).double().cpu() - exact).abs().max().item()
    ours = mpfused.gemm(a, b, out_dtype=out_dtype)
    assert ours.dtype == out_dtype and ours.shape == (m, n)
    our_err = (ours.double().cpu() - exact).abs().max().item()
    assert torch_err > 0
    if device == "cpu":  # beside ATen's FP32 GEMM (on CUDA cuBLAS may be far below its bound: see tolerances)
        assert our_err <= GEMM_ERROR_FACTOR[out_dtype] * torch_err, (our_err, torch_err)
    # element by element within the FP32 accumulation bound plus the output rounding within the FP32 accumulation bound plus the output rounding
    gamma = k * GEMM_ACCUM_U / (1 - k * GEMM_ACCUM_U)
    abs_ab = torch.matmul(a.double().cpu().abs(), b.double().cpu().abs())
    h = GEMM_OUT_HALF_ULP[out_dtype]
    bound = h * exact.abs() + (1 + h) * gamma * abs_ab + GEMM_OUT_SUBNORMAL_HALF[out_dtype]
    err = (ours.double().cpu() - exact).abs()
    assert bool((err <= bound).all()), f"worst err/bound {(err / bound).max().item():.3f}"


# ---- epilogues -----------------------------------------------------------------------------------------
def ref_epilogue(acc, *, alpha=1.0, beta=0.0, c=None, bias=None, activation=None):
    """The epilogue in torch FP32 ops, in core/gemm.h's order, each operation rounded once."""
    y = acc.float().cpu() * alpha
    if c is not None and beta != 0:
        y = y + c.float().cpu() * beta
    if bias is not None:
        y = y + bias.float().cpu()
    if activation == "relu":
        y = torch.relu(y)
    elif activation == "gelu":
        y = F.gelu(y, approximate="tanh")
    elif activation == "gelu_erf":
        y = F.gelu(y)
    return y


def int_problem(device, dtype, m=37, n=45, k=29, batch=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lead = () if batch is None else (batch,)
    a = ints(lead + (m, k), dtype, device, gen)
    b = ints(lead + (k, n), dtype, device, gen)
    return a, b, torch.matmul(a.double().cpu(), b.double().cpu()), gen


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_bias_and_relu_bitwise(device, dtype, bias_dtype, activation):
    a, b, acc, gen = int_problem(device, dtype)
    bias = (torch.randn(acc.shape[-1], generator=gen) * 8).to(bias_dtype).to(device)
    for out_dtype in OUT_DTYPES:
        out = mpfused.gemm(a, b, bias=bias, activation=activation, out_dtype=out_dtype)
        assert_bitwise(out, ref_epilogue(acc, bias=bias, activation=activation).to(out_dtype or dtype))
    if activation == "relu":
        out = mpfused.gemm(a, b, bias=bias, activation="relu", out_dtype=torch.float32)
        assert (out >= 0).all() and (out == 0).any() and (out > 0).any()


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("activation", ["gelu", "gelu_erf"])
def test_gelu_against_torch(device, dtype, activation):
    a, b, acc, gen = int_problem(device, dtype, m=64, n=96, k=40)
    bias = (torch.randn(acc.shape[-1], generator=gen) * 4).to(device)
    for alpha in (1.0, 0.25):  # 0.25: pre-activations around zero, where the GELU curves
        for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
            out = mpfused.gemm(a, b, bias=bias, activation=activation, alpha=alpha, out_dtype=out_dtype)
            ref = ref_epilogue(acc, alpha=alpha, bias=bias, activation=activation)
            rtol, atol = GELU_TOL[out_dtype]
            torch.testing.assert_close(out.cpu().float(), ref.to(out_dtype).float(), rtol=rtol, atol=atol)
    # The two GELUs differ from each other and from the identity: a mixed-up activation would fail above.
    tanh = mpfused.gemm(a, b, bias=bias, activation="gelu", alpha=0.25, out_dtype=torch.float32)
    erf = mpfused.gemm(a, b, bias=bias, activation="gelu_erf", alpha=0.25, out_dtype=torch.float32)
    assert not torch.equal(tanh, erf)


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("c_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_alpha_beta_c_bitwise(device, dtype, c_dtype):
    a, b, acc, gen = int_problem(device, dtype)
    c = (torch.randn(acc.shape, generator=gen) * 10).to(c_dtype).to(device)
    bias = torch.randn(acc.shape[-1], generator=gen).to(dtype).to(device)
    for alpha, beta in ((1.0, 1.0), (0.1, -1.7), (-2.5, 0.3)):
        for out_dtype in OUT_DTYPES:
            out = mpfused.gemm(a, b, alpha=alpha, beta=beta, c=c, bias=bias, activation="relu", out_dtype=out_dtype)
            ref = ref_epilogue(acc, alpha=alpha, beta=beta, c=c, bias=bias, activation="relu")
            assert_bitwise(out, ref.to(out_dtype or dtype))
    # c read through a transposed view (column-major), without a copy
    ct = (torch.randn(acc.shape[::-1], generator=gen) * 10).to(c_dtype).to(device).t()
    out = mpfused.gemm(a, b, alpha=0.5, beta=2.0, c=ct, out_dtype=torch.float32)
    assert_bitwise(out, ref_epilogue(acc, alpha=0.5, beta=2.0, c=ct))


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", LOW)
def test_c_broadcast_over_batch_and_per_batch(device, dtype):
    a, b, acc, gen = int_problem(device, dtype, batch=3)
    shared = (torch.randn(acc.shape[1:], generator=gen) * 4).to(device)
    per_batch = (torch.randn(acc.shape, generator=gen) * 4).to(torch.bfloat16).to(device)
    for c in (shared, per_batch):
        out = mpfused.gemm(a, b, beta=0.75, c=c, out_dtype=torch.float32)
        assert out.shape == acc.shape
        assert_bitwise(out, ref_epilogue(acc, beta=0.75, c=c))
    assert not torch.equal(mpfused.gemm(a, b, beta=0.75, c=shared), mpfused.gemm(a, b, beta=0.75, c=per_batch))


@pytest.mark.parametrize("dtype", LOW)
def test_beta_zero_does_not_read_c(device, dtype):
    a, b, acc, _ = int_problem(device, dtype)
    plain = mpfused.gemm(a, b, out_dtype=torch.float32)
    for bad in (float("nan"), float("inf")):
        c = torch.full(acc.shape, bad, device=device)
        out = mpfused.gemm(a, b, c=c, beta=0.0, out_dtype=torch.float32)
        assert out.isfinite().all()
        assert_bitwise(out, plain)
    # ... while beta != 0 does read it
    nan_c = torch.full(acc.shape, float("nan"), device=device)
    assert mpfused.gemm(a, b, c=nan_c, beta=1.0).isnan().all()


@pytest.mark.sanitize
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_erf"])
def test_pre_activation_is_the_value_before_the_activation(device, activation):
    a, b, acc, gen = int_problem(device, torch.bfloat16)
    bias = torch.randn(acc.shape[-1], generator=gen).to(device)
    out, pre = _ops.gemm(a, b, bias, activation, 0.5, 0.0, None, torch.float16, return_pre_activation=True)
    assert_bitwise(pre, ref_epilogue(acc, alpha=0.5, bias=bias).to(torch.float16))
    assert_bitwise(out, mpfused.gemm(a, b, bias=bias, activation=activation, alpha=0.5, out_dtype=torch.float16))
    assert (pre is out) == (activation is None)


@pytest.mark.parametrize("activation", [None, "relu"])
def test_gradients_of_both_outputs_of_gemm_with_pre_reach_the_operands(device, activation):
    # A loss through `pre` as well as `out`: both gradients count, also without an activation, where `pre`
    # is a copy of `out` (its gradient was once dropped there, silently). Small integers: exact in FP32.
    a, b, acc, gen = int_problem(device, torch.bfloat16, m=6, n=5, k=7)
    a.requires_grad_(True)
    b.requires_grad_(True)
    out, pre = torch.ops.mpfused.gemm_with_pre(a, b, None, activation, 1.0, 0.0, None, torch.float32)
    g_out = torch.randint(-3, 4, out.shape, generator=gen).float()
    g_pre = torch.randint(-3, 4, out.shape, generator=gen).float()
    torch.autograd.backward([out, pre], [g_out.to(device), g_pre.to(device)])
    keep = torch.ones_like(acc) if activation is None else (acc > 0).double()
    g = g_out.double() * keep + g_pre.double()
    assert_bitwise(a.grad, (g @ b.detach().double().cpu().t()).to(torch.bfloat16))
    assert_bitwise(b.grad, (a.detach().double().cpu().t() @ g).to(torch.bfloat16))


@pytest.mark.sanitize
def test_k_zero_is_the_epilogue_of_zero(device):
    a = torch.empty(5, 0, dtype=torch.float16, device=device)
    b = torch.empty(0, 4, dtype=torch.float16, device=device)
    bias = torch.tensor([1.5, -2.0, 0.25, -0.0], device=device)
    c = torch.arange(20, dtype=torch.float32, device=device).reshape(5, 4)
    out = mpfused.gemm(a, b, bias=bias, c=c, beta=2.0, activation="relu", out_dtype=torch.float32)
    assert_bitwise(out, torch.relu(2.0 * c + bias).cpu())
    assert_bitwise(mpfused.gemm(a, b), torch.zeros(5, 4, dtype=torch.float16))


@pytest.mark.sanitize
def test_empty_outputs(device):
    h = dict(dtype=torch.float16, device=device)
    assert mpfused.gemm(torch.empty(0, 3, **h), torch.ones(3, 4, **h)).shape == (0, 4)
    assert mpfused.gemm(torch.ones(2, 3, **h), torch.empty(3, 0, **h), out_dtype=torch.float32).shape == (2, 0)
    out = mpfused.gemm(torch.empty(0, 2, 3, **h), torch.ones(3, 4, **h), bias=torch.ones(4, device=device))
    assert out.shape == (0, 2, 4) and out.dtype == torch.float16
    out, pre = _ops.gemm(torch.empty(0, 3, **h), torch.ones(3, 4, **h), None, "gelu", return_pre_activation=True)
    assert out.shape == pre.shape == (0, 4)


# ---- operand layouts -----------------------------------------------------------------------------------
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", LOW)
def test_unaligned_leading_dims_and_views(device, dtype):
    gen = torch.Generator().manual_seed(5)
    m, n, k = 33, 19, 45
    wide_a = ints((m, k + 5), dtype, device, gen)
    wide_b = ints((k + 3, n + 7), dtype, device, gen)
    cases = {
        "slice a[:, :K-1] (odd ld)": (wide_a[:, : k - 1], wide_b[: k - 1, :n]),
        "row and column offsets (misaligned pointers)": (wide_a[1:, 1:k], wide_b[2 : k + 1, 3 : n + 3]),
        "transposed slices (odd ld, misaligned)": (ints((k + 4, m + 2), dtype, device, gen)[2 : k + 2, 1 : m + 1].t(),
                                                   ints((n + 5, k + 1), dtype, device, gen)[:n, 1:].t()),
        "strided columns (copied)": (wide_a[:, ::2], ints((math.ceil((k + 5) / 2), n), dtype, device, gen)),
        "strided rows and columns (copied)": (wide_a[::2, ::3], ints((40, 30), dtype, device, gen)[::2, ::2][:17]),
    }
    for name, (a, b) in cases.items():
        assert a.shape[1] == b.shape[0], name
        for out_dtype in (None, torch.float32):
            assert_bitwise(mpfused.gemm(a, b, out_dtype=out_dtype), reference(a, b, out_dtype))


@pytest.mark.sanitize
def test_size_one_dims_with_arbitrary_strides(device):
    gen = torch.Generator().manual_seed(9)
    big = ints((4000,), torch.float16, device, gen)
    k, n = 40, 24
    b = ints((k, n), torch.float16, device, gen)
    cases = [
        big.as_strided((1, k), (777, 1)),  # one row, arbitrary row stride
        big.as_strided((1, k), (1, 1)),  # one row, column stride 1, row stride 1 (both layouts fit)
        big.as_strided((k, 1), (3, 5)).t(),  # a transposed column, stride 3 along K: col-major, ld 3
        big.as_strided((1, k), (0, 1)),  # expanded row
    ]
    for a in cases:
        assert_bitwise(mpfused.gemm(a, b, out_dtype=torch.float32), reference(a, b, torch.float32))
    # a single column of b (N == 1): contiguous along K, or a column of a wider matrix
    wide = ints((k, 9), torch.float16, device, gen)
    a = ints((7, k), torch.float16, device, gen)
    for col in (wide[:, 4:5], wide[:, 4:5].contiguous(), big[:k].as_strided((k, 1), (1, 99))):
        assert_bitwise(mpfused.gemm(a, col), reference(a, col, None))


def tight(rows, cols, col_major, dtype, device, gen):
    """A (rows, cols) operand whose leading dimension is a whole number of 16-byte vectors (the kernels' vector
    path) but whose sizes are not, in storage that ends at its last element: a tail copy that reads a whole
    vector reads past the allocation, which compute-sanitizer's memcheck reports (with torch's caching
    allocator off, as the sanitizer stage runs)."""
    inner, outer = (rows, cols) if col_major else (cols, rows)
    ld = -(-inner // 8) * 8
    flat = ints(((outer - 1) * ld + inner,), dtype, device, gen)
    t = flat.as_strided((outer, inner), (ld, 1))
    t = t.t() if col_major else t
    assert t.shape == (rows, cols) and t.data_ptr() % 16 == 0 and max(t.stride()) % 8 == 0
    return t


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["nn", "tn", "nt", "tt"])
def test_partial_vectors_at_the_end_of_the_storage(device, dtype, ta, tb):
    """The vector path with partial 16-byte vectors along every edge (M, N and K not multiples of 8), each
    operand's storage ending at its last element, in every layout: exact small-integer products. Where the
    tails were copied with cp.async's zero-fill, memcheck on an H200 reported 16-byte reads past the end."""
    gen = torch.Generator().manual_seed(77 + 2 * ta + tb)
    for m, n, k in [(70, 50, 44), (37, 29, 61), (130, 259, 75)]:
        a, b = tight(m, k, ta, dtype, device, gen), tight(k, n, tb, dtype, device, gen)
        assert_bitwise(mpfused.gemm(a, b, out_dtype=torch.float32), reference(a, b, torch.float32))


@pytest.mark.sanitize
def test_batched_operand_layouts(device):
    gen = torch.Generator().manual_seed(11)
    dtype = torch.bfloat16
    a = ints((3, 21, 18), dtype, device, gen)
    b = ints((18, 14), dtype, device, gen)
    cases = [
        (a, b.expand(3, -1, -1)),  # batch stride 0
        (a.transpose(-1, -2).contiguous().transpose(-1, -2), b),  # 3-D col-major a, shared b
        (ints((21, 18), dtype, device, gen), ints((3, 14, 18), dtype, device, gen).transpose(-1, -2)),  # shared a
        (ints((6, 21, 18), dtype, device, gen)[::2], ints((3, 18, 20), dtype, device, gen)[:, :, 3:17]),
        (a.permute(1, 0, 2).contiguous().permute(1, 0, 2), b),  # batch dim in the middle of memory
    ]
    for x, y in cases:
        out = mpfused.gemm(x, y, out_dtype=torch.float32)
        assert out.shape == (3, 21, 14)
        assert_bitwise(out, reference(x, y, torch.float32))


# ---- bad input -----------------------------------------------------------------------------------------
def bad_cases(device):
    h = dict(dtype=torch.float16, device=device)
    a, b = torch.ones(4, 5, **h), torch.ones(5, 6, **h)
    a3 = torch.ones(2, 4, 5, **h)
    return [
        (dict(a=a.float()), "a must be a float16 or bfloat16 tensor"),
        (dict(a=a.to(torch.int32)), "a must be a float16 or bfloat16 tensor"),
        (dict(b=b.to(torch.complex64)), "b must be a float16 or bfloat16 tensor"),
        (dict(b=b.double()), "b must be a float16 or bfloat16 tensor"),
        (dict(b=b.bfloat16()), "b must have a's dtype Half"),
        (dict(a=torch.ones(5, **h)), "a must be 2-D"),
        (dict(b=torch.ones(1, 1, 5, 6, **h)), "b must be 2-D"),
        (dict(b=torch.ones(4, 6, **h)), "b must have 5 rows"),
        (dict(a=a3, b=torch.ones(3, 5, 6, **h)), "b must have a's batch size 2"),
        (dict(a=a.to_sparse()), "a must be a dense"),
        (dict(b=torch.ones(5, 6, dtype=torch.float16, device="meta")), "b is on meta but a is on"),
        (dict(bias=torch.ones(5, device=device)), "bias must be 1-D with 6 elements"),
        (dict(bias=torch.ones(1, 6, device=device)), "bias must be 1-D with 6 elements"),
        (dict(bias=torch.ones(6, dtype=torch.int64, device=device)), "bias must be a float32, float16 or bfloat16"),
        (dict(bias=torch.ones(6, device="meta")), "bias is on meta but a is on"),  # the fake kernel's device check
        (dict(c=torch.ones(4, 5, device=device), beta=1.0), "c must have the output's shape"),
        (dict(c=torch.ones(2, 4, 6, device=device), beta=1.0), "c must have the output's shape"),
        (dict(a=a3, c=torch.ones(3, 4, 6, device=device), beta=1.0), "c must have the output's shape"),
        (dict(c=torch.ones(4, 6, dtype=torch.int32, device=device), beta=1.0), "c must be a float32, float16"),
        (dict(c=torch.ones(4, 6, device="meta"), beta=1.0), "c is on meta but a is on"),
        (dict(c=torch.ones(6, device=device), beta=1.0), "c must have the output's shape"),
        (dict(beta=0.5), "beta != 0 needs c"),
        (dict(alpha=float("nan")), "alpha must be a finite number"),
        (dict(beta=1e300, c=torch.ones(4, 6, device=device)), "beta must be a finite number"),
        (dict(activation="swish"), "activation must be None, 'relu'"),
        (dict(activation="GELU"), "activation must be None, 'relu'"),
        (dict(out_dtype=torch.float64), "out_dtype must be"),
        (dict(out_dtype=torch.int8), "out_dtype must be"),
    ]


def call(kwargs, device, fn=mpfused.gemm):
    h = dict(dtype=torch.float16, device=device)
    args = dict(a=torch.ones(4, 5, **h), b=torch.ones(5, 6, **h))
    args.update(kwargs)
    return fn(args.pop("a"), args.pop("b"), **args)


@pytest.mark.parametrize("case", range(len(bad_cases("cpu"))))
def test_bad_input_names_the_argument_and_writes_nothing(device, case):
    kwargs, message = bad_cases(device)[case]
    before = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"
              and v.layout == torch.strided}
    with pytest.raises(ValueError, match=message):
        call(kwargs, device)
    for k, v in before.items():
        assert torch.equal(kwargs[k], v), f"{k} was modified"


def test_operator_validates_by_itself(device):
    """The operator (torch.ops.mpfused.gemm) raises the same errors when called directly: the Python
    wrapper only checks Python types, the validation is the operator's."""
    h = dict(dtype=torch.float16, device=device)
    a, b = torch.ones(4, 5, **h), torch.ones(5, 6, **h)
    for kwargs, message in [(dict(out_dtype=torch.float64), "out_dtype must be"),
                            (dict(activation="swish"), "activation must be"),
                            (dict(a=a.float()), "a must be a float16"),
                            (dict(a=a.to_sparse()), "a must be a dense"),
                            (dict(beta=0.5), "beta != 0 needs c")]:
        args = dict(a=a, b=b)
        args.update(kwargs)
        with pytest.raises(ValueError, match=message):
            torch.ops.mpfused.gemm(args.pop("a"), args.pop("b"), **args)
    for activation in (7, True):  # the schema's str? refuses other types before the kernel runs
        with pytest.raises(RuntimeError, match="activation"):
            torch.ops.mpfused.gemm(a, b, activation=activation)
    with pytest.raises(TypeError, match="activation must be None"):
        mpfused.gemm(a, b, activation=1)


def test_wrong_argument_types(device):
    h = dict(dtype=torch.float16, device=device)
    a, b = torch.ones(4, 5, **h), torch.ones(5, 6, **h)
    with pytest.raises(TypeError, match="alpha must be a Python int or float"):
        mpfused.gemm(a, b, alpha=torch.tensor(2.0))
    with pytest.raises(TypeError, match="bias must be a tensor or None"):
        mpfused.gemm(a, b, bias=[1.0] * 6)
    with pytest.raises(TypeError, match="b must be a tensor"):
        mpfused.gemm(a, b.tolist())
    with pytest.raises(TypeError):
        mpfused.gemm(a, b, None)  # keyword-only epilogue arguments


def _grad_cases():
    # (a shape, b shape, bias, c shape, activation, alpha, beta, out_dtype)
    return [
        ((6, 8), (8, 5), True, None, None, 1.0, 0.0, None),
        ((6, 8), (8, 5), True, None, "relu", 1.0, 0.0, None),
        ((6, 8), (8, 5), False, (6, 5), "gelu", 0.5, 2.0, None),
        ((6, 8), (8, 5), True, None, "gelu_erf", 1.0, 0.0, torch.float32),
        ((3, 6, 8), (8, 5), True, (6, 5), None, 1.5, -1.0, None),  # b and c shared by every batch
        ((6, 8), (3, 8, 5), False, (3, 6, 5), "relu", 1.0, 1.0, None),  # a shared
        ((3, 6, 8), (3, 8, 5), True, None, "gelu", 1.0, 0.0, torch.float32),
    ]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(_grad_cases())))
def test_gradients_match_float64_autograd(device, dtype, case):
    """mpfused.gemm is differentiable (the operator's autograd formula, mpfused/_ops.py): its gradients for
    a, b, bias and c match float64 autograd of the same formula on the same low-precision values to a few
    roundings of the dtype (LINEAR_REL_TOL, relative to the largest reference value)."""
    a_shape, b_shape, has_bias, c_shape, act, alpha, beta, out_dtype = _grad_cases()[case]
    g = torch.Generator().manual_seed(case)
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)  # noqa: E731
    a, b = make(*a_shape), make(*b_shape)
    bias = make(b_shape[-1]) if has_bias else None
    c = make(*c_shape) if c_shape else None
    leaves = [t for t in (a, b, bias, c) if t is not None]
    for t in leaves:
        t.requires_grad_(True)
    out = mpfused.gemm(a, b, bias=bias, activation=act, alpha=alpha, beta=beta, c=c, out_dtype=out_dtype)
    seed = torch.randn(out.shape, generator=g).to(out.dtype).to(device)
    grads = torch.autograd.grad(out, leaves, seed)

    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    ra, rb = ref_leaves[0], ref_leaves[1]
    rest = iter(ref_leaves[2:])
    rbias = next(rest) if bias is not None else None
    rc = next(rest) if c is not None else None
    y = alpha * torch.matmul(ra, rb) + (beta * rc if rc is not None else 0) + (rbias if rbias is not None else 0)
    y = {None: y, "relu": torch.relu(y), "gelu": torch.nn.functional.gelu(y, approximate="tanh"),
         "gelu_erf": torch.nn.functional.gelu(y)}[act]
    ref = torch.autograd.grad(y, ref_leaves, seed.double())
    tol = LINEAR_REL_TOL[dtype]
    for name, got, want, leaf in zip("a b bias c".split(), grads, ref, leaves):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape, name
        err = (got.double() - want).abs().max().item()
        assert err <= tol * max(want.abs().max().item(), 1.0), f"grad of {name}: error {err}"


def test_no_grad_gives_no_graph():
    a = torch.ones(4, 5, dtype=torch.float16, requires_grad=True)
    b = torch.ones(5, 6, dtype=torch.float16)
    with torch.no_grad():
        assert mpfused.gemm(a, b).requires_grad is False
    assert mpfused.gemm(a, b).requires_grad is True


def test_runs_in_fp32_under_autocast(device):
    """torch.autocast must not turn the FP32 accumulation into a low-precision GEMM."""
    a = torch.ones(2, 300, dtype=torch.bfloat16, device=device)
    b = torch.ones(300, 2, dtype=torch.bfloat16, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = mpfused.gemm(a, b, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and (out == 300.0).all()  # 300 is not a BF16 value


@requires_cuda
def test_mixed_devices_are_rejected_on_cuda():
    a = torch.ones(4, 5, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="b is on cpu but a is on cuda"):
        mpfused.gemm(a, torch.ones(5, 6, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias must be on cuda"):
        mpfused.gemm(a, a.t(), bias=torch.ones(4))


def test_gemm_kernel_query_without_a_gpu():
    """_C.gemm_cuda_kernel names the kernel aligned operands take; without CUDA kernels or without a device it is a
    clear error, not a crash."""
    if not mpfused.has_cuda_kernels():
        with pytest.raises(ValueError, match="no CUDA kernels"):
            _ops._C.gemm_cuda_kernel(0)
        return
    match = "index must name a visible CUDA device" if torch.cuda.device_count() else "no CUDA device is visible"
    with pytest.raises(ValueError, match=match):
        _ops._C.gemm_cuda_kernel(torch.cuda.device_count())


def test_gemm_launch_record_without_a_gpu():
    """_C.gemm_last_cuda_launch: a clear error on a build without CUDA kernels; (None, None) on a thread that has
    run no CUDA GEMM."""
    if not mpfused.has_cuda_kernels():
        with pytest.raises(ValueError, match="no CUDA kernels"):
            _ops._C.gemm_last_cuda_launch()
        return
    import threading

    seen = []
    t = threading.Thread(target=lambda: seen.append(_ops._C.gemm_last_cuda_launch()))
    t.start()
    t.join()
    assert seen == [(None, None)]


# Aligned operands in every layout, batched B, K tails, and (for the cluster form) odd numbers of tile rows: the
# Hopper kernel itself must run them. Its results equal the WMMA kernel's, so the other tests pass on a silent
# fallback to it (a tensor map the driver refuses, too few registers, no cluster that fits): this one fails then.
# (Every extent a multiple of 8 elements: 16-byte aligned rows.)
HOPPER_SHAPES = [(1, 304, 264, 72, False, False, False), (2, 136, 520, 136, True, False, True),
                 (1, 520, 264, 200, False, True, False), (3, 264, 136, 64, True, True, True)]


@pytest.mark.parametrize("batch,m,n,k,a_col,b_col,b_batched", HOPPER_SHAPES)
def test_the_hopper_kernel_itself_runs_aligned_operands(device, request, batch, m, n, k, a_col, b_col, b_batched):
    kernel = request.node.callspec.params["device"]
    if not kernel.startswith("cuda-wgmma"):
        pytest.skip("the Hopper kernel's own check (the cuda-wgmma devices)")
    expected = "wgmma-cluster" if kernel == "cuda-wgmma-cluster" and m > 128 else "wgmma"
    gen = torch.Generator().manual_seed(m + n + k)
    for dtype in LOW:
        a = ints((batch, k, m) if a_col else (batch, m, k), dtype, "cuda", gen)
        lead = (batch,) if b_batched else ()
        b = ints(lead + ((k, n) if not b_col else (n, k)), dtype, "cuda", gen)
        a = a.transpose(-1, -2) if a_col else a
        b = b.transpose(-1, -2) if b_col else b
        out = mpfused.gemm(a, b, out_dtype=torch.float32)
        assert _ops._C.gemm_last_cuda_launch() == (expected, None), (dtype, _ops._C.gemm_last_cuda_launch())
        assert torch.equal(out, torch.matmul(a.float(), b.float()))
    # an empty output launches nothing: the record says so rather than naming the last call's kernel
    mpfused.gemm(a[..., :0, :], b)
    assert _ops._C.gemm_last_cuda_launch() == (None, None)


def test_an_operand_whose_rows_overlap_takes_the_wmma_kernel_quietly(device, request):
    """An expand()ed operand (row stride 0) is aligned, so the Hopper kernel is selected, but its rows overlap: no
    tensor map's layout. It was handed to the driver's encoder (a refusal there warns, as unexpected); now the
    Hopper kernel passes it over with the reason, and the WMMA kernel runs it. (On the CPU and with the WMMA
    kernel: the product itself.)"""
    kernel = request.node.callspec.params["device"]
    gen = torch.Generator().manual_seed(3)
    for dtype in LOW:
        a = ints((1, 64), dtype, device, gen).expand(136, 64)
        b = ints((64, 136), dtype, device, gen)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = mpfused.gemm(a, b, out_dtype=torch.float32)
        assert torch.equal(out, torch.matmul(a.float(), b.float()))
        if kernel.startswith("cuda-wgmma"):
            ran, why = _ops._C.gemm_last_cuda_launch()
            assert ran == "wmma" and "rows overlap" in why, (ran, why)


@requires_cuda
def test_unknown_gemm_kernel_setting_is_an_error(monkeypatch):
    """An MPFUSED_GEMM_KERNEL that is not 'wmma', 'wgmma' or 'wgmma-cluster' fails the call with a message naming it, on any
    GPU and build (checked before the kernel is chosen); 'wmma' runs the WMMA kernel."""
    a = torch.ones(8, 8, dtype=torch.float16, device="cuda")
    monkeypatch.setenv("MPFUSED_GEMM_KERNEL", "fastest")
    with pytest.raises((RuntimeError, ValueError), match="MPFUSED_GEMM_KERNEL"):
        mpfused.gemm(a, a)
    monkeypatch.setenv("MPFUSED_GEMM_KERNEL", "wmma")
    assert _ops._C.gemm_cuda_kernel(torch.cuda.current_device()) == "wmma"
    assert torch.equal(mpfused.gemm(a, a).float(), torch.full((8, 8), 8.0, device="cuda"))
