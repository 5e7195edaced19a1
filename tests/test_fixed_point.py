"""mpfused.fixed_point: Convert(x, <IL,FL>) (quantize/encode/decode), the MACC (matmul) and training in
fixed point (FixedPointLinear, FixedPointSGD), against exact references: float64 numpy for Convert (every
step of it is exact in double) and Python integers for the MACC; the random words come from
mpfused.random.philox_words, so the stochastic results are checked bit for bit too."""

import copy
import hashlib
import math
import os
import subprocess
import sys
import textwrap
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.utils.checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

import mpfused
from mpfused import fixed_point as fxp
from mpfused import optim as mo
from mpfused.random import philox_words

from conftest import requires_cuda
from mpfused import _ops
from test_random import reference_words
from tolerances import SR_SIGMAS

FORMATS = [(1, 0), (1, 7), (2, 14), (4, 12), (8, 8), (1, 15), (6, 10), (12, 12), (16, 16), (1, 31), (32, 0)]


def words(n, seed, offset, device="cpu"):
    return philox_words(n, seed, offset).numpy().astype(np.float64)


def ref_codes(x, il, fl, rounding="nearest", seed=0, offset=0, word_source=None):
    """Convert in float64 numpy (exact: x * 2^fl, the clamp to integer bounds, floor and frac are exact).
    word_source(n, seed, offset): the random values (default: the extension's philox_words)."""
    x = np.asarray(x, dtype=np.float64)
    lo, hi = -(2.0 ** (il + fl - 1)), 2.0 ** (il + fl - 1) - 1
    v = np.nan_to_num(x * 2.0 ** fl, nan=0.0, posinf=hi, neginf=lo)
    v = np.clip(v, lo, hi)
    n = np.floor(v)
    frac = v - n
    if rounding == "nearest":
        up = frac > 0.5
    else:
        w = (word_source or words)(x.size, seed, offset)
        up = np.asarray(w, dtype=np.float64).reshape(x.shape) < frac * 2.0 ** 32
    return (n + up).astype(np.int64)


def sample_values(fmt, n, gen):
    """Values across and beyond the format's range, on and off the grid, plus exact ties."""
    il, fl = fmt
    span = 2.0 ** (il - 1)
    x = (torch.rand(n, generator=gen, dtype=torch.float64) * 2.4 - 1.2) * span
    ties = (torch.randint(-(1 << min(il + fl - 1, 20)), 1 << min(il + fl - 1, 20), (n // 4,), generator=gen)
            .double() + 0.5) * 2.0 ** -fl
    x = torch.cat([x, ties, torch.tensor([0.0, -0.0, span, -span, span * 4, -span * 4])])
    return x.float()


# ---- Convert ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_encode_matches_the_exact_reference(fmt, rounding, device):
    il, fl = fmt
    gen = torch.Generator().manual_seed(il * 100 + fl)
    x = sample_values(fmt, 4000, gen)
    codes = fxp.encode(x.to(device), il, fl, rounding=rounding, seed=7, offset=123)
    assert codes.dtype == (torch.int16 if il + fl <= 16 else torch.int32)
    expected = ref_codes(x.double().numpy(), il, fl, rounding, seed=7, offset=123)
    np.testing.assert_array_equal(codes.cpu().numpy().astype(np.int64), expected)
    assert expected.min() >= -(2 ** (il + fl - 1)) and expected.max() <= 2 ** (il + fl - 1) - 1


@pytest.mark.sanitize
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_quantize_is_decode_of_encode_and_on_the_grid(fmt, device):
    il, fl = fmt
    f = fxp.FixedPointFormat(il, fl)
    x = sample_values(fmt, 2000, torch.Generator().manual_seed(1)).to(device)
    for rounding in ("nearest", "stochastic"):
        q = fxp.quantize(x, il, fl, rounding=rounding, seed=3)
        assert q.dtype == (torch.float32 if il + fl <= 24 else torch.float64) == f.value_dtype
        c = fxp.encode(x, il, fl, rounding=rounding, seed=3)
        assert torch.equal(fxp.decode(c, il, fl), q)
        scaled = q.double() * 2.0 ** fl
        assert torch.equal(scaled, scaled.round())  # on the grid
        assert q.min().item() >= f.min and q.max().item() <= f.max


def test_nearest_ties_go_down_for_both_signs():
    # <4, 2>: eps = 0.25. Ties: x = floor + eps/2 -> floor (towards -inf).
    x = torch.tensor([0.125, 0.375, -0.125, -0.375, 1.125, 0.1251, -0.1249, 0.0, 2.0 ** -30])
    q = fxp.quantize(x, 4, 2)
    assert q.tolist() == [0.0, 0.25, -0.25, -0.5, 1.0, 0.25, 0.0, 0.0, 0.0]


def test_saturation_inf_and_nan():
    x = torch.tensor([100.0, -100.0, math.inf, -math.inf, math.nan, 7.9, -8.0, -8.1, 7.875, 7.8751])
    for rounding in ("nearest", "stochastic"):
        q = fxp.quantize(x, 4, 3, rounding=rounding, seed=1)  # range [-8, 8 - 1/8]
        assert q.tolist()[:5] == [7.875, -8.0, 7.875, -8.0, 0.0]
        assert q.tolist()[6:] == [-8.0, -8.0, 7.875, 7.875]
    c = fxp.encode(x, 4, 3)
    assert c.tolist()[:5] == [63, -64, 63, -64, 0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_input_dtypes_give_the_float32_result(dtype, device):
    x = sample_values((6, 10), 3000, torch.Generator().manual_seed(5)).to(dtype)
    for rounding in ("nearest", "stochastic"):
        ours = fxp.encode(x.to(device), 6, 10, rounding=rounding, seed=9)
        ref = ref_codes(x.double().numpy(), 6, 10, rounding, seed=9)
        np.testing.assert_array_equal(ours.cpu().numpy().astype(np.int64), ref)


def test_float64_input_keeps_its_low_bits():
    # 1 + 2^-30 is 1.0 in float32; in float64 its fraction (2^-10 of a step of <12, 20>) decides the rounding.
    n = 1 << 16
    x = torch.full((n,), 1.0 + 2.0 ** -30, dtype=torch.float64)
    ups = (fxp.encode(x, 12, 20, rounding="stochastic", seed=2) == (1 << 20) + 1).sum().item()
    expected = (words(n, 2, 0) < 2.0 ** -10 * 2.0 ** 32).sum()
    assert ups == expected and 20 < ups < 150
    assert (fxp.encode(x.float(), 12, 20, rounding="stochastic", seed=2) == 1 << 20).all()


@pytest.mark.parametrize("p", [0.5, 0.1, 0.9, 1 / 3, 2.0 ** -10])
def test_stochastic_rounding_is_unbiased(p, device):
    # x = a + p * eps: the count of round-ups is Binomial(n, p'), p' = ceil(p * 2^16) / 2^16 (within 2^-16).
    n = 1 << 18
    fmt = (4, 6)
    eps = 2.0 ** -6
    for a in (1.5, -2.25):
        x = torch.full((n,), a + p * eps, dtype=torch.float64).float()
        frac = (x[0].double().item() - a) / eps  # the float32 value's own fraction
        q = fxp.quantize(x.to(device), *fmt, rounding="stochastic", seed=11).cpu().double()
        assert set(torch.unique(q).tolist()) <= {a, a + eps}
        ups = (q == a + eps).sum().item()
        sigma = math.sqrt(n * frac * (1 - frac))
        assert abs(ups - n * frac) <= SR_SIGMAS * sigma, (a, p, ups, n * frac, sigma)


@pytest.mark.sanitize
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_offset_slicing(rounding, device):
    x = torch.randn(5003, generator=torch.Generator().manual_seed(2)).to(device) * 3
    full = fxp.quantize(x, 3, 12, rounding=rounding, seed=5, offset=17)
    for k in (1, 2, 3, 4, 1000, 1027, 5000):
        part = fxp.quantize(x[k:], 3, 12, rounding=rounding, seed=5, offset=17 + k)
        assert torch.equal(part, full[k:])
    # A non-contiguous input is read in row-major order.
    m = x[:5000].reshape(50, 100)
    assert torch.equal(fxp.quantize(m.t(), 3, 12, rounding=rounding, seed=5),
                       fxp.quantize(m.t().contiguous(), 3, 12, rounding=rounding, seed=5))


@pytest.mark.sanitize
def test_stochastic_convert_across_a_carry_of_the_block_counter(device):
    # The Philox block index (element index / 8) carries out of its low 32-bit word inside the tensor, which
    # starts off a block boundary. The reference words come from the raw generator
    # (test_random.reference_words), not from philox_words, which shares the CPU's pass logic.
    x = torch.randn(3000, generator=torch.Generator().manual_seed(8)) * 3
    offset = ((1 << 32) - 40) * 8 + 5
    for fmt in ((4, 12), (12, 12)):
        codes = fxp.encode(x.to(device), *fmt, rounding="stochastic", seed=9, offset=offset)
        expected = ref_codes(x.double().numpy(), *fmt, "stochastic", seed=9, offset=offset,
                             word_source=reference_words)
        np.testing.assert_array_equal(codes.cpu().numpy().astype(np.int64), expected)


def test_same_bits_for_every_thread_count():
    x = torch.randn(600_000, generator=torch.Generator().manual_seed(4)) * 4
    a = torch.randint(-(1 << 12), 1 << 12, (64, 300), generator=torch.Generator().manual_seed(5), dtype=torch.int16)
    b = torch.randint(-(1 << 12), 1 << 12, (300, 700), generator=torch.Generator().manual_seed(6), dtype=torch.int16)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append((fxp.quantize(x, 4, 12, rounding="stochastic", seed=1),
                            fxp.encode(x, 4, 12, rounding="stochastic", seed=1, offset=3 * 1024 + 5),
                            fxp.encode(x, 4, 12), fxp.matmul(a, b, (4, 12), (4, 12), (8, 8), rounding="stochastic",
                                                             seed=3)))
    finally:
        torch.set_num_threads(before)
    for r in results[1:]:
        for ours, first in zip(r, results[0]):
            assert torch.equal(ours, first)


# ---- the MACC -----------------------------------------------------------------------------------------
def ref_matmul(a, b, fa, fb, fo, rounding="nearest", seed=0, offset=0):
    """Python integers: the exact sum, rounded once (floor + the nearest/stochastic rule), saturated."""
    (m, k), n = a.shape, b.shape[1]
    a, b = a.tolist(), b.tolist()
    s = fa[1] + fb[1] - fo[1]
    lo, hi = -(1 << (sum(fo) - 1)), (1 << (sum(fo) - 1)) - 1
    w = philox_words(m * n, seed, offset).tolist() if rounding == "stochastic" else None
    out = []
    for i in range(m):
        row = []
        for j in range(n):
            acc = sum(a[i][p] * b[p][j] for p in range(k))
            if s <= 0:
                v = acc << -s
            else:
                fl, rem = acc >> s, acc & ((1 << s) - 1)
                frac = Fraction(rem, 1 << s)
                up = frac > Fraction(1, 2) if w is None else w[i * n + j] < frac * (1 << 32)
                v = fl + up
            row.append(min(max(v, lo), hi))
        out.append(row)
    return out


def random_codes(shape, fmt, gen, dtype):
    wl = sum(fmt)
    return torch.randint(-(1 << (wl - 1)), 1 << (wl - 1), shape, generator=gen, dtype=torch.int64).to(dtype)


fmt_st = st.tuples(st.integers(1, 12), st.integers(0, 14)).filter(lambda f: sum(f) <= 16)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(0, 9), k=st.integers(0, 40), n=st.integers(0, 9), fa=fmt_st, fb=fmt_st,
       fo=st.tuples(st.integers(1, 16), st.integers(0, 30)).filter(lambda f: sum(f) <= 32),
       rounding=st.sampled_from(["nearest", "stochastic"]), seed=st.integers(0, 2**64 - 1),
       offset=st.integers(0, 2**40), data_seed=st.integers(0, 1000), wide=st.booleans())
def test_matmul_matches_python_integers(m, k, n, fa, fb, fo, rounding, seed, offset, data_seed, wide):
    gen = torch.Generator().manual_seed(data_seed)
    a = random_codes((m, k), fa, gen, torch.int32 if wide else torch.int16)
    b = random_codes((k, n), fb, gen, torch.int16)
    out = fxp.matmul(a, b, fa, fb, fo, rounding=rounding, seed=seed, offset=offset)
    assert out.shape == (m, n) and out.dtype == (torch.int16 if sum(fo) <= 16 else torch.int32)
    assert out.tolist() == ref_matmul(a, b, fa, fb, fo, rounding, seed, offset)


@pytest.mark.sanitize
@pytest.mark.parametrize("fo", [(2, 0), (8, 24), (16, 16), (1, 31), (20, 2)])
def test_matmul_wide_formats_and_large_shifts(fo, device):
    # 32- and 31-bit codes, K = 2 (32 + 31 + 1 = 64: the widest MACC allowed): sums up to 2^62, shifts up
    # to 61 (fl 31 + 30 - 0).
    gen = torch.Generator().manual_seed(8)
    fa, fb = (1, 31), (1, 30)
    a = random_codes((5, 2), fa, gen, torch.int32)
    b = random_codes((2, 4), fb, gen, torch.int32)
    a[0, :] = -(1 << 31)
    b[:, 0] = -(1 << 30)  # the largest products, 2^61 each: the sum 2^62
    for rounding in ("nearest", "stochastic"):
        out = fxp.matmul(a.to(device), b.to(device), fa, fb, fo, rounding=rounding, seed=4)
        assert out.cpu().tolist() == ref_matmul(a, b, fa, fb, fo, rounding, 4)


def test_matmul_stochastic_offsets_follow_the_output_index():
    gen = torch.Generator().manual_seed(9)
    a = random_codes((6, 20), (4, 12), gen, torch.int16)
    b = random_codes((20, 7), (4, 12), gen, torch.int16)
    full = fxp.matmul(a, b, (4, 12), (4, 12), (8, 8), rounding="stochastic", seed=2, offset=5)
    rows = fxp.matmul(a[2:], b, (4, 12), (4, 12), (8, 8), rounding="stochastic", seed=2, offset=5 + 2 * 7)
    assert torch.equal(rows, full[2:])


def test_matmul_larger_than_a_column_block():
    gen = torch.Generator().manual_seed(10)
    a = random_codes((3, 70), (4, 12), gen, torch.int16)
    b = random_codes((70, 1100), (4, 12), gen, torch.int16)
    out = fxp.matmul(a, b, (4, 12), (4, 12), (10, 6), rounding="stochastic", seed=1)
    assert out.tolist() == ref_matmul(a, b, (4, 12), (4, 12), (10, 6), "stochastic", 1)


def test_matmul_overflow_width_is_a_value_error():
    a = torch.zeros((2, 3), dtype=torch.int32)
    b = torch.zeros((3, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match="WL_a \\+ WL_b \\+ ceil\\(log2 K\\)"):
        fxp.matmul(a, b, (1, 31), (1, 31), (8, 8))  # 32 + 32 + 2 > 64
    assert fxp.matmul(a[:, :1], b[:1], (1, 31), (1, 31), (8, 8)).tolist() == [[0, 0], [0, 0]]  # K = 1: 64 fits


def test_matmul_overflow_bound_is_exact():
    a = torch.zeros((1, 2), dtype=torch.int32)
    b = torch.zeros((2, 1), dtype=torch.int32)
    fxp.matmul(a, b, (1, 31), (1, 30), (4, 4))  # 32 + 31 + 1 = 64
    with pytest.raises(ValueError, match="K=2"):
        fxp.matmul(a, b, (1, 31), (1, 31), (4, 4))  # 32 + 32 + 1 = 65


def test_the_operator_bounds_the_sum_by_the_codes_themselves_on_the_cpu():
    """torch.ops.mpfused.fixed_point_matmul takes codes beyond their formats (FixedPointLinear's bias column
    holds 1.0 where il = 1), so the WL rule alone did not keep its int64 sum from overflowing: int32 codes
    near 2^31 over K = 4 wrapped, silently (every output -2^31 where the sum is about +2^64, which saturates
    to +2^31 - 1). On the CPU it now bounds the sum by max|a| * max|b| * K <= 2^62 and raises past it;
    codes in range never pass it (-2^31 squared, K = 1, is exactly 2^62)."""
    op = torch.ops.mpfused.fixed_point_matmul
    big = torch.full((2, 4), 2**31 - 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="codes up to \\|a\\| = 2147483647 and \\|b\\| = 2147483647 over K = 4"):
        op(big, big.t().contiguous(), 1, 0, 1, 0, 32, 0, False, 0, 0, torch.int32)
    low = torch.full((3, 1), -2**31, dtype=torch.int32)
    out = op(low, low.t().contiguous(), 1, 31, 1, 31, 32, 0, False, 0, 0, torch.int32)
    assert out.tolist() == [[1] * 3] * 3  # 2^62 with 62 fractional bits
    assert fxp.matmul(low, low.t(), (1, 31), (1, 31), (32, 0)).tolist() == out.tolist()


# ---- bad input: a clear error naming the argument, nothing modified ----------------------------------
@pytest.mark.parametrize("call, exc, name", [
    (lambda x: fxp.quantize(x, 0, 4), ValueError, "il"),
    (lambda x: fxp.quantize(x, 4, -1), ValueError, "fl"),
    (lambda x: fxp.quantize(x, 20, 13), ValueError, "il \\+ fl"),
    (lambda x: fxp.quantize(x, True, 4), TypeError, "il"),
    (lambda x: fxp.quantize(x, 4, 2.0), TypeError, "fl"),
    (lambda x: fxp.quantize(x, 4, 4, rounding="up"), ValueError, "rounding"),
    (lambda x: fxp.quantize(x, 4, 4, rounding="stochastic", seed=-1), ValueError, "seed"),
    (lambda x: fxp.quantize(x, 4, 4, seed=2**64), ValueError, "seed"),
    (lambda x: fxp.quantize(x, 4, 4, offset=2**64 - 3), ValueError, "offset"),
    (lambda x: fxp.quantize(x.tolist(), 4, 4), TypeError, "x"),
    (lambda x: fxp.quantize(x.long(), 4, 4), ValueError, "x must be a float32"),
    (lambda x: fxp.encode(torch.complex(x, x), 4, 4), ValueError, "x must be"),
    (lambda x: fxp.decode(x, 4, 4), ValueError, "codes"),
    (lambda x: fxp.decode(x.short(), 4, 40), ValueError, "il \\+ fl"),
])
def test_bad_convert_arguments(call, exc, name):
    x = torch.linspace(-3, 3, 10)
    before = x.clone()
    with pytest.raises(exc, match=name):
        call(x)
    assert torch.equal(x, before)


@pytest.mark.sanitize
@pytest.mark.parametrize("fmt", [(4, 12), (12, 12), (16, 16), (1, 0)], ids=str)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_out_argument_writes_the_allocating_result(fmt, rounding, device):
    """quantize/encode(out=) write what the allocating call returns, bit for bit, into the caller's tensor
    (returned), in the call's own dtype and in a wider one (float64 values, int32 codes)."""
    gen = torch.Generator().manual_seed(sum(fmt))
    x = sample_values(fmt, 3000, gen)[:3750].reshape(3, -1).to(device)
    kw = dict(rounding=rounding, seed=2**63 + 5, offset=2**35 - 7)
    fm = fxp.FixedPointFormat(*fmt)
    for fn, dtypes in ((fxp.quantize, {fm.value_dtype, torch.float64}), (fxp.encode, {fm.code_dtype, torch.int32})):
        want = fn(x, *fmt, **kw)
        for dtype in dtypes:
            out = torch.full_like(x, 77, dtype=dtype)
            got = fn(x, *fmt, out=out, **kw)
            assert got is out
            assert torch.equal(out, want.to(dtype)), (fn.__name__, dtype)


def test_out_argument_is_checked_before_anything_is_written():
    x = torch.linspace(-3, 3, 16)
    cases = [  # (call, out, exception, message)
        (lambda o: fxp.quantize(x, 4, 8, out=o), torch.zeros(16, dtype=torch.int16), ValueError,
         "out must be a torch.float32 or torch.float64 tensor .quantize gives values., got torch.int16"),
        (lambda o: fxp.encode(x, 4, 8, out=o), torch.zeros(16), ValueError,
         "out must be a torch.int16 or torch.int32 tensor .encode gives codes., got torch.float32"),
        (lambda o: fxp.quantize(x, 16, 16, out=o), torch.zeros(16), ValueError,
         "out's dtype float32 cannot hold the values of a format with il \\+ fl = 32"),
        (lambda o: fxp.encode(x, 12, 12, out=o), torch.zeros(16, dtype=torch.int16), ValueError,
         "out's dtype torch.int16 cannot hold codes of 24 bits"),
        (lambda o: fxp.quantize(x, 4, 8, out=o), torch.zeros(15), ValueError, "out must be a contiguous Float tensor"),
        (lambda o: fxp.quantize(x, 4, 8, out=o), torch.zeros(4, 4), ValueError, "of x's shape \\[16\\]"),
        (lambda o: fxp.quantize(x, 4, 8, out=o[::2]), torch.zeros(32), ValueError, "not contiguous"),
        (lambda o: fxp.quantize(x, 4, 8, out=o.tolist()), torch.zeros(16), TypeError, "out must be a tensor"),
        (lambda o: fxp.quantize(x, 4, 8, rounding="stochastic", offset=2**64 - 8, out=o), torch.zeros(16),
         ValueError, "offset"),
        (lambda o: fxp.quantize(x, 0, 8, out=o), torch.zeros(16), ValueError, "il"),
    ]
    for call, out, exc, msg in cases:
        before = out.clone()
        with pytest.raises(exc, match=msg):
            call(out)
        assert torch.equal(out, before), msg
    shared = torch.zeros(40)
    before = shared.clone()
    with pytest.raises(ValueError, match="out must not overlap x"):
        fxp.quantize(shared[10:26], 4, 8, out=shared[20:36])
    with pytest.raises(ValueError, match="out must not overlap x"):  # the codes too (2 bytes each)
        fxp.encode(shared[:16], 4, 8, out=shared[8:16].view(torch.int16))
    assert torch.equal(shared, before)
    # a strided x is read through a contiguous copy: then out may share x's storage
    base = torch.linspace(-3, 3, 32)
    want = fxp.quantize(base[::2], 4, 8)
    fxp.quantize(base[::2], 4, 8, out=base[16:])
    assert torch.equal(base[16:], want)


@pytest.mark.parametrize("make, exc, name", [
    (lambda a, b: fxp.matmul(a.float(), b, (4, 4), (4, 4), (4, 4)), ValueError, "a_codes"),
    (lambda a, b: fxp.matmul(a, b.long(), (4, 4), (4, 4), (4, 4)), ValueError, "b_codes"),
    (lambda a, b: fxp.matmul(a, b.t(), (4, 4), (4, 4), (4, 4)), ValueError, "b_codes must have 3 rows"),
    (lambda a, b: fxp.matmul(a[0], b, (4, 4), (4, 4), (4, 4)), ValueError, "a_codes must be 2-D"),
    (lambda a, b: fxp.matmul(a, b, (12, 12), (4, 4), (4, 4)), ValueError, "fmt_a"),
    (lambda a, b: fxp.matmul(a, b, (4, 4), (0, 4), (4, 4)), ValueError, "fmt_b"),
    (lambda a, b: fxp.matmul(a, b, (4, 4), (4, 4), [4, 4]), TypeError, "fmt_out"),
    (lambda a, b: fxp.matmul(a, b, (4, 4), (4, 4), (4, 4), rounding="x"), ValueError, "rounding"),
    (lambda a, b: fxp.matmul(a, None, (4, 4), (4, 4), (4, 4)), TypeError, "b_codes"),
    (lambda a, b: fxp.matmul(a, b, (4, 4), (4, 4), (4, 4), offset=2**64 - 1), ValueError, "offset"),
    # codes beyond their format (<2,2>: codes -8 .. 7; b holds up to 11) could overflow the int64 sum
    (lambda a, b: fxp.matmul(a, b, (4, 4), (2, 2), (4, 4)), ValueError, r"b_codes must hold codes of <2,2>, in \[-8, 7\]"),
    (lambda a, b: fxp.matmul(a - 9, b, (2, 2), (4, 4), (4, 4)), ValueError, r"a_codes .* got values in \[-9, -4\]"),
])
def test_bad_matmul_arguments(make, exc, name):
    a = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    b = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    a0, b0 = a.clone(), b.clone()
    with pytest.raises(exc, match=name):
        make(a, b)
    assert torch.equal(a, a0) and torch.equal(b, b0)


def test_matmul_of_codes_beyond_their_format_raises_where_the_sum_would_overflow():
    a = torch.full((1, 4), 2**31 - 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="a_codes must hold codes of <17,0>"):
        fxp.matmul(a, a.t().contiguous(), (17, 0), (17, 0), (32, 0))


@pytest.mark.parametrize("in_features,out_features", [(0, 3), (3, 0), (0, 0)])
def test_linear_with_a_zero_size_dim_works_as_torchs(in_features, out_features):
    # (reshape(-1, 0) is ambiguous: forward raised for in_features=0, backward for out_features=0)
    layer = fxp.FixedPointLinear(in_features, out_features, fmt=(4, 8), grad_fmt=(8, 8))  # (10 fits <8,8>)
    x = torch.randn(2, 5, in_features, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (2, 5, out_features) and torch.equal(y, layer.bias.detach().expand(2, 5, out_features))
    assert torch.equal(x.grad, torch.zeros_like(x)) and layer.weight.grad.shape == (out_features, in_features)
    assert torch.equal(layer.bias.grad, torch.full((out_features,), 10.0))


def test_linear_rejects_input_of_the_wrong_width():
    layer = fxp.FixedPointLinear(4, 3, fmt=(4, 8))
    for x in (torch.ones(2, 5), torch.tensor(1.0)):
        with pytest.raises(ValueError, match=r"input must be a tensor of shape \(\.\.\., in_features=4\)"):
            layer(x)


def test_linear_takes_float32_and_float64_inputs_only():
    # The output, a value of fmt exact in float32, comes back in the input's dtype: a float16 or bfloat16
    # input had it rounded a second time (<8,8>'s 119.53125 came back as 119.5), an integer one truncated
    layer = fxp.FixedPointLinear(6, 1, (8, 8), rounding="nearest", bias=False)
    with torch.no_grad():
        layer.weight.fill_(0.99609375)
    x = torch.full((1, 6), 20.0)
    assert layer(x).item() == 119.53125 and layer(x.double()).item() == 119.53125
    assert layer(x.double()).dtype == torch.float64
    for dtype in (torch.float16, torch.bfloat16, torch.int32):
        with pytest.raises(ValueError, match=f"input must be a float32 or float64 tensor, got {dtype}"):
            layer(x.to(dtype))
    assert layer.calls == 3  # (a refused input is not a call)


def test_inputs_on_another_device_are_named():
    """The operator's message named its own arguments (b and a); these name the layer's input and matmul's."""
    layer = fxp.FixedPointLinear(4, 3, (4, 8))
    with pytest.raises(ValueError, match="input is on meta but the layer's weight is on cpu"):
        layer(torch.randn(2, 4, device="meta"))
    a = torch.zeros(2, 2, dtype=torch.int16)
    with pytest.raises(ValueError, match="b_codes is on cpu but a_codes is on meta"):
        fxp.matmul(a.to("meta"), a, (4, 4), (4, 4), (4, 4))
    assert layer.calls == 0


@pytest.mark.parametrize("key, bad", [("rounding", "up"), ("fmt", (0, 4)), ("lr", "x"), ("lr", float("nan")),
                                      ("seed", 1.5), ("momentum", 1.0)])
def test_sgd_checks_every_group_before_writing_any(key, bad):
    """Group 0's param, step count and momentum buffer stay as they were when group 1 holds a bad value."""
    p0, p1 = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = fxp.FixedPointSGD([{"params": [p0]}, {"params": [p1]}], lr=0.25, fmt=(4, 8), momentum=0.5)
    p0.grad, p1.grad = torch.ones(4), torch.ones(4)
    opt.step()
    before = (p0.detach().clone(), opt.state[p0]["momentum_buffer"].clone(), opt.state[p0]["step"])
    opt.param_groups[1][key] = bad
    with pytest.raises((ValueError, TypeError), match=f"{key}.*param group 1"):
        opt.step()
    after = (p0.detach(), opt.state[p0]["momentum_buffer"], opt.state[p0]["step"])
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]) and before[2] == after[2]


@pytest.mark.parametrize("key, bad, match", [
    ("step", torch.tensor(1.0), "state\\['step'\\] of param 0 of param group 1 must be an int"),
    ("step", -1, "state\\['step'\\] of param 0 of param group 1 must be an int"),
    ("step", 2.0, "state\\['step'\\] of param 0 of param group 1 must be an int"),
    ("momentum_buffer", torch.ones(3), "state\\['momentum_buffer'\\] of param 0 of param group 1 must be a float32 tensor"),
    ("momentum_buffer", [1.0], "state\\['momentum_buffer'\\] of param 0 of param group 1 must be a float32 tensor")])
def test_sgd_checks_every_state_before_writing_any(key, bad, match):
    """A state edited by hand (or loaded from elsewhere) in group 1 stops the step before group 0 is written;
    it wrote group 0, then raised an error that named the seed (for a tensor step) or none at all."""
    p0, p1 = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = fxp.FixedPointSGD([{"params": [p0]}, {"params": [p1]}], lr=0.25, fmt=(4, 8), momentum=0.5)
    p0.grad, p1.grad = torch.ones(4), torch.ones(4)
    opt.step()
    before = (p0.detach().clone(), opt.state[p0]["momentum_buffer"].clone(), opt.state[p0]["step"])
    opt.state[p1][key] = bad
    with pytest.raises(TypeError, match=match):
        opt.step()
    after = (p0.detach(), opt.state[p0]["momentum_buffer"], opt.state[p0]["step"])
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]) and before[2] == after[2]


def test_cpu_matmul_takes_more_rows_than_the_cuda_grid_holds():
    # 4194241 rows: one more than CUDA's 65535 rows of 64-row tiles, which the CPU loops never had
    m = 65535 * 64 + 1
    a = torch.arange(m, dtype=torch.int64).remainder(7).sub(3).to(torch.int16)[:, None]
    out = fxp.matmul(a, torch.full((1, 2), 2, dtype=torch.int16), (4, 4), (4, 4), (8, 8))
    assert out.shape == (m, 2) and torch.equal(out, (a.to(torch.int32) * 2).expand(m, 2).to(out.dtype))


@pytest.mark.parametrize("kw", [dict(nesterov=True), dict(dampening=0.1), dict(weight_decay=1e-4),
                                dict(maximize=True)])
def test_sgd_refuses_a_state_dict_of_another_update_rule(kw):
    p = torch.nn.Parameter(torch.zeros(4))
    saved = torch.optim.SGD([p], lr=0.25, momentum=0.5, **kw).state_dict()
    opt = fxp.FixedPointSGD([p], lr=0.1, fmt=(4, 8), momentum=0.9)
    key = next(iter(kw))
    with pytest.raises(ValueError, match=f"param group 0 of the state dict has {key}="):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.9


def test_sgd_loads_torch_and_fused_sgd_state_dicts():
    # torch.optim.SGD's groups have no fmt, rounding or seed (a KeyError at the next step); FusedSGD's count
    # their steps in a float32 tensor, and their rounding and seed are their FP16/BF16 write-back's (taken,
    # they once switched a stochastic FixedPointSGD to nearest): each group keeps its own fixed-point values
    for make in (lambda ps: torch.optim.SGD([{"params": [p]} for p in ps], lr=0.25, momentum=0.5),
                 lambda ps: mo.FusedSGD([{"params": [p]} for p in ps], lr=0.25, momentum=0.5, seed=3)):
        p, q = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))
        other = make([p, q])
        for _ in range(2):
            p.grad, q.grad = torch.ones(4), torch.ones(2)
            other.step()
        opt = fxp.FixedPointSGD([{"params": [p]}, {"params": [q], "fmt": (6, 10), "seed": 11}], lr=0.25, fmt=(4, 8),
                                momentum=0.5, seed=9, rounding="stochastic")
        opt.load_state_dict(other.state_dict())
        group = opt.param_groups[0]
        assert group["fmt"] == (4, 8) and group["seed"] == 9 and group["momentum"] == 0.5
        assert group["rounding"] == "stochastic" and opt.param_groups[1]["rounding"] == "stochastic"
        assert opt.param_groups[1]["fmt"] == (6, 10) and opt.param_groups[1]["seed"] == 11
        assert opt.state[p].get("step", 0) in (0, 2) and torch.equal(opt.state[p]["momentum_buffer"], torch.full((4,), 1.5))
        p.grad = torch.ones(4)
        opt.step()  # after -0.25, -0.625: m = 0.5 * 1.5 + 1 = 1.75, p = -0.625 - 0.25 * 1.75 (on the 2^-8 grid)
        assert torch.equal(p.detach(), torch.full((4,), -1.0625))


def test_format_dataclass():
    f = fxp.FixedPointFormat(2, 14)
    assert (f.wl, f.eps, f.min, f.max, f.code_min, f.code_max) == (16, 2.0**-14, -2.0, 2 - 2.0**-14, -32768, 32767)
    assert f.code_dtype == torch.int16 and fxp.FixedPointFormat(1, 16).code_dtype == torch.int32
    assert str(f) == "<2,14>"
    with pytest.raises(ValueError, match="il"):
        fxp.FixedPointFormat(0, 3)


# ---- CUDA == CPU, bit for bit -------------------------------------------------------------------------
@pytest.mark.sanitize
@pytest.mark.cuda
def test_cuda_matches_cpu_bit_for_bit(device):
    if device != "cuda":
        pytest.skip("compares the CUDA backend with the CPU")
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(100_003, generator=gen) * 5
    for fmt in ((4, 12), (8, 16), (1, 31)):
        for rounding in ("nearest", "stochastic"):
            for off in (0, 3):
                assert torch.equal(fxp.encode(x.cuda(), *fmt, rounding=rounding, seed=6, offset=off).cpu(),
                                   fxp.encode(x, *fmt, rounding=rounding, seed=6, offset=off))
                assert torch.equal(fxp.quantize(x[1:].cuda(), *fmt, rounding=rounding, seed=6, offset=off).cpu(),
                                   fxp.quantize(x[1:], *fmt, rounding=rounding, seed=6, offset=off))
    for (m, k, n) in ((1, 1, 1), (65, 17, 130), (200, 300, 90)):
        a = random_codes((m, k), (4, 12), gen, torch.int16)
        b = random_codes((k, n), (16, 16), gen, torch.int32)
        for rounding in ("nearest", "stochastic"):
            cpu = fxp.matmul(a, b, (4, 12), (16, 16), (10, 14), rounding=rounding, seed=1, offset=9)
            gpu = fxp.matmul(a.cuda(), b.cuda(), (4, 12), (16, 16), (10, 14), rounding=rounding, seed=1, offset=9)
            assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 255, 17), (2, 256, 64), (5, 257, 65), (4, 1_000, 130), (7, 2_049, 3)])
def test_macc_of_int16_codes_is_exact_at_the_extremes(m, k, n):
    """The MACC of int16 codes (on avx2/avx512 by pairs of k through 16-bit multiply-adds, a code split into a signed
    high and an unsigned low digit, 32-bit sums moved to 64 bits every 256 steps of k) equals the int64 product
    rounded once: random codes and the extremes +-2^15, odd K, K across several moves, columns and rows off the
    register blocks."""
    gen = torch.Generator().manual_seed(m * 1000 + k)
    cases = [random_codes((m, k), (4, 12), gen, torch.int16), random_codes((k, n), (4, 12), gen, torch.int16)]
    ext = [torch.where(torch.rand(s, generator=gen) < 0.5, 32767, -32768).to(torch.int16) for s in ((m, k), (k, n))]
    # every code 32767 in a and -32768 in b (and -32768 in both): each digit's sum grows the same way at every step
    # of k, past int32's range by K ~ 1000 unless the 32-bit sums move to 64 bits in time
    same = [(torch.full((m, k), x, dtype=torch.int16), torch.full((k, n), -32768, dtype=torch.int16)) for x in (32767, -32768)]
    for a, b in (cases, ext, (ext[0], cases[1]), *same):
        exact = a.long() @ b.long()
        shift = 16  # <4,12> x <4,12> -> <24,8>: int32 codes, which hold every sum here
        floor, rem = exact >> shift, exact & ((1 << shift) - 1)
        expected = floor + (rem > (1 << (shift - 1))).long()
        assert torch.equal(fxp.matmul(a, b, (4, 12), (4, 12), (24, 8)).long(), expected)


def test_macc_kernel_query_without_a_gpu():
    """_C.fixed_matmul_cuda_kernel names the CUDA MACC kernel of int16 codes; without CUDA kernels or without a device
    it is a clear error, not a crash."""
    if not mpfused.has_cuda_kernels():
        with pytest.raises(ValueError, match="no CUDA kernels"):
            _ops._C.fixed_matmul_cuda_kernel(0)
        return
    match = "index must name a visible CUDA device" if torch.cuda.device_count() else "no CUDA device is visible"
    with pytest.raises(ValueError, match=match):
        _ops._C.fixed_matmul_cuda_kernel(torch.cuda.device_count())


def offset_codes(values: torch.Tensor, offset: int) -> torch.Tensor:
    """values (2-D) copied into a contiguous tensor whose data starts `offset` elements into its storage."""
    flat = torch.empty(values.numel() + offset, dtype=values.dtype, device=values.device)
    out = flat[offset:].view(values.shape)
    out.copy_(values)
    return out


@pytest.mark.sanitize
@requires_cuda
def test_cuda_macc_on_tensor_cores_matches_cpu(monkeypatch):
    """The int16 MACC on the integer tensor cores (8-bit digits of biased codes, three int32 sums moved to 64 bits every
    16,384 steps of k) gives the CPU's codes, and so does the CUDA-core kernel: tails in every dimension, several
    tiles, operands whose data is off the vector alignment, the extreme codes (digits 0 and 255) and depths past the
    int32 sums' span."""
    gen = torch.Generator().manual_seed(21)
    major, minor = torch.cuda.get_device_capability()
    expected = "tensor-cores" if (major, minor) >= (7, 2) else "cuda-cores"
    monkeypatch.delenv("MPFUSED_FIXED_MATMUL_KERNEL", raising=False)
    assert _ops._C.fixed_matmul_cuda_kernel(torch.cuda.current_device()) == expected
    cases = [((70, 40, 130), "random", 0), ((33, 45, 61), "random", 1), ((5, 3, 9), "extremes", 3),
             ((129, 100, 3), "random", 0), ((64, 32, 64), "extremes", 0), ((2, 8, 68), "max", 4),
             ((3, 16_384 + 200, 5), "max", 0), ((17, 16_384 + 9, 6), "extremes", 2), ((200, 300, 90), "random", 0)]
    for (m, k, n), pattern, offset in cases:
        if pattern == "random":
            a, b = (random_codes(s, (4, 12), gen, torch.int16) for s in ((m, k), (k, n)))
        elif pattern == "extremes":
            a, b = (torch.where(torch.rand(s, generator=gen) < 0.5, 32767, -32768).to(torch.int16) for s in ((m, k), (k, n)))
        else:
            a, b = torch.full((m, k), 32767, dtype=torch.int16), torch.full((k, n), 32767, dtype=torch.int16)
        ga, gb = offset_codes(a.cuda(), offset), offset_codes(b.cuda(), offset)
        for out_fmt in ((8, 8), (24, 8)):  # int16 codes (the deep sums saturate) and int32 ones (none saturate)
            for rounding in ("nearest", "stochastic"):
                cpu = fxp.matmul(a, b, (4, 12), (4, 12), out_fmt, rounding=rounding, seed=3, offset=5)
                for kernel in ("tensor-cores", "cuda-cores"):
                    monkeypatch.setenv("MPFUSED_FIXED_MATMUL_KERNEL", kernel)
                    gpu = fxp.matmul(ga, gb, (4, 12), (4, 12), out_fmt, rounding=rounding, seed=3, offset=5)
                    assert torch.equal(gpu.cpu(), cpu), (m, k, n, pattern, offset, out_fmt, rounding, kernel)
                monkeypatch.delenv("MPFUSED_FIXED_MATMUL_KERNEL")
    monkeypatch.setenv("MPFUSED_FIXED_MATMUL_KERNEL", "fastest")
    with pytest.raises((RuntimeError, ValueError), match="MPFUSED_FIXED_MATMUL_KERNEL"):
        fxp.matmul(ga, gb, (4, 12), (4, 12), (10, 14))


# ---- every CPU path gives the same bits ---------------------------------------------------------------
PKG_ROOT = Path(mpfused.__file__).resolve().parents[1]
SUPPORTED = mpfused.build_info()["cpu_isa_supported"].split(", ")
DIGEST = """
import hashlib, torch
from mpfused import fixed_point as fxp
g = torch.Generator().manual_seed(0)
x = torch.randn(70_001, generator=g) * 6
a = torch.randint(-2**15, 2**15, (33, 80), generator=g, dtype=torch.int32).short()
b = torch.randint(-2**15, 2**15, (80, 530), generator=g, dtype=torch.int32).short()
h = hashlib.sha256()
for r in ("nearest", "stochastic"):
    for t in (x, x.half(), x.bfloat16(), x.double()):
        h.update(fxp.encode(t, 5, 11, rounding=r, seed=3, offset=1).numpy().tobytes())
        h.update(fxp.quantize(t, 9, 20, rounding=r, seed=3).numpy().tobytes())
    h.update(fxp.matmul(a, b, (4, 12), (4, 12), (12, 12), rounding=r, seed=5).numpy().tobytes())
print(h.hexdigest())
"""


def test_every_cpu_path_gives_the_same_bits():
    digests = {}
    for isa in ("scalar", "avx2", "avx512"):
        if isa not in SUPPORTED:
            continue
        env = dict(os.environ, MPFUSED_CPU_ISA=isa, PYTHONPATH=str(PKG_ROOT))
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(DIGEST)], env=env, cwd=PKG_ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        digests[isa] = r.stdout.strip()
    assert len(digests) >= 1 and len(set(digests.values())) == 1, digests


# ---- training in fixed point --------------------------------------------------------------------------
def test_linear_forward_and_backward_are_the_exact_fixed_point_math():
    torch.manual_seed(0)
    fmt, gfmt = fxp.FixedPointFormat(4, 12), fxp.FixedPointFormat(2, 14)
    layer = fxp.FixedPointLinear(20, 7, fmt, grad_fmt=gfmt, rounding="nearest", seed=1)
    x = torch.randn(5, 20, requires_grad=True)
    y = layer(x)
    gy = torch.randn(5, 7) * 0.01
    y.backward(gy)
    q = lambda t, f: fxp.quantize(t, f.il, f.fl)  # noqa: E731
    xq, w, b = q(x.detach(), fmt).double(), layer.weight.detach().double(), layer.bias.detach().double()
    assert torch.equal(q(layer.weight.detach(), fmt), layer.weight.detach())  # weights on the grid
    exact = xq @ w.t() + b  # dyadic values with <= 24 fractional bits: exact in float64
    assert torch.equal(y.detach(), q(exact, fmt))
    g = q(gy, gfmt).double()
    assert torch.equal(x.grad, q(g @ w, gfmt))
    assert torch.equal(layer.weight.grad, q(g.t() @ xq, gfmt))
    assert torch.equal(layer.bias.grad, q(g.sum(0), gfmt))
    assert layer.calls == 1


def test_sgd_nearest_loses_small_updates_stochastic_keeps_them_on_average():
    fmt = fxp.FixedPointFormat(2, 8)  # eps = 2^-8
    w0 = torch.full((20_000,), 0.5)
    grad = torch.full_like(w0, 0.3 * 2.0 ** -8)  # lr 1: the update is 0.3 of a grid step
    for rounding, expect in (("nearest", 0.5), ("stochastic", 0.5 - 0.3 * 2.0 ** -8)):
        p = torch.nn.Parameter(w0.clone())
        opt = fxp.FixedPointSGD([p], lr=1.0, fmt=fmt, rounding=rounding, seed=3)
        p.grad = grad.clone()
        opt.step()
        assert torch.equal(fxp.quantize(p.detach(), 2, 8), p.detach())
        mean = p.detach().double().mean().item()
        sigma = 2.0 ** -8 * math.sqrt(0.3 * 0.7 / w0.numel())
        assert abs(mean - expect) <= SR_SIGMAS * sigma, (rounding, mean, expect)


def _train(model, opt, steps, gen_seed):
    gen = torch.Generator().manual_seed(gen_seed)
    for _ in range(steps):
        x = torch.randn(16, 12, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _model(seed):
    torch.manual_seed(seed)
    fmt = fxp.FixedPointFormat(4, 12)
    return torch.nn.Sequential(fxp.FixedPointLinear(12, 16, fmt, seed=10), torch.nn.ReLU(),
                               fxp.FixedPointLinear(16, 3, fmt, seed=11))


def test_sgd_resume_is_bit_identical():
    fmt = (4, 12)
    model = _model(0)
    opt = fxp.FixedPointSGD(model.parameters(), lr=0.05, fmt=fmt, rounding="stochastic", seed=5, momentum=0.9)
    _train(model, opt, 5, 1)
    saved_model = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in model.state_dict().items()}
    import copy
    saved_opt = copy.deepcopy(opt.state_dict())
    _train(model, opt, 5, 2)

    resumed = _model(99)  # different initial weights, overwritten by the state dict
    resumed.load_state_dict(saved_model)
    opt2 = fxp.FixedPointSGD(resumed.parameters(), lr=0.05, fmt=fmt, rounding="stochastic", seed=0, momentum=0.9)
    opt2.load_state_dict(saved_opt)  # the seed comes back with the param groups
    _train(resumed, opt2, 5, 2)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert [m.calls for m in resumed if hasattr(m, "calls")] == [10, 10]
    # and the run did move: a different seed gives different weights
    other = _model(0)
    opt3 = fxp.FixedPointSGD(other.parameters(), lr=0.05, fmt=fmt, rounding="stochastic", seed=6, momentum=0.9)
    _train(other, opt3, 10, 1)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def test_training_arguments_are_checked():
    with pytest.raises(ValueError, match="bias"):
        fxp.FixedPointLinear(3, 2, (1, 15))
    with pytest.raises(ValueError, match="fmt"):
        fxp.FixedPointLinear(3, 2, (4, 24))
    with pytest.raises(ValueError, match="rounding"):
        fxp.FixedPointLinear(3, 2, (4, 4), rounding="round")
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="lr"):
        fxp.FixedPointSGD([p], lr=-1.0, fmt=(2, 8))
    with pytest.raises(ValueError, match="momentum"):
        fxp.FixedPointSGD([p], lr=0.1, fmt=(2, 8), momentum=1.0)
    with pytest.raises(ValueError, match="fmt"):
        fxp.FixedPointSGD([p], lr=0.1, fmt=(2, 30))


def test_fixed_point_sgd_checks_added_groups_and_unwritable_params_before_writing():
    """A group added with its own values was checked only at step() (fmt=(0, 3) was taken), and an expand()ed
    param in a later group failed in its write, after the params before it had been written. add_param_group
    now checks the group's values (and drops the group when they fail), and step() refuses a param whose
    elements share memory before anything is written."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = fxp.FixedPointSGD([p], lr=0.5, fmt=(4, 8), rounding="nearest")
    for bad, match in [(dict(fmt=(0, 3)), "il"), (dict(lr=float("nan")), "lr must be a finite number"),
                       (dict(momentum=-0.5), "momentum"), (dict(rounding="up"), "rounding"), (dict(seed=-1), "seed")]:
        with pytest.raises(ValueError, match=match):
            opt.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(2))], **bad))
        assert len(opt.param_groups) == 1
    opt.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(2))], fmt=[2, 6], lr=1))
    assert opt.param_groups[1]["fmt"] == (2, 6) and opt.param_groups[1]["lr"] == 1.0
    wide = torch.nn.Parameter(torch.zeros(1).expand(4))
    opt.add_param_group(dict(params=[wide]))
    p.grad, wide.grad = torch.ones(3), torch.ones(4)
    opt.param_groups[1]["params"][0].grad = torch.ones(2)
    with pytest.raises(ValueError, match="param 0 of param group 2 has elements that share memory"):
        opt.step()
    assert not p.any() and not opt.state
    wide.grad = None
    opt.step()
    assert p.tolist() == [-0.5] * 3


def test_fixed_point_sgd_refuses_a_param_made_half_or_an_inference_param_before_writing():
    """add_param_group checks the dtype, but `p.data = p.data.half()` (model.half() after the optimizer was
    built) came after it, and the step wrote FP16 values off the grid; an inference tensor raised in its
    write, after the params before it and their states had been written."""
    def make():
        a = torch.nn.Parameter(torch.ones(4))
        b = torch.nn.Parameter(torch.ones(4))
        a.grad, b.grad = torch.full((4,), 0.5), torch.ones(4)
        return a, b, fxp.FixedPointSGD([a, b], lr=0.25, fmt=(4, 4), rounding="nearest")

    a, b, opt = make()
    b.data = b.data.half()
    with pytest.raises(ValueError, match="param 1 of param group 0 must be a float32 tensor"):
        opt.step()
    assert a.tolist() == [1.0] * 4 and not opt.state
    a, b, opt = make()
    with torch.inference_mode():
        frozen = torch.nn.Parameter(torch.ones(4))
    frozen.grad = torch.ones(4)
    opt.param_groups[0]["params"][1] = frozen
    with pytest.raises(ValueError, match="param 1 of param group 0 is an inference tensor"):
        opt.step()
    assert a.tolist() == [1.0] * 4 and not opt.state


@pytest.mark.parametrize("fmt", [(1, 0), (4, 12), (8, 8), (2, 22), (12, 12), (1, 23)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fp32_arithmetic_gives_the_fp64_codes(device, fmt, rounding):
    # FP32 inputs of formats with WL <= 24 take the FP32 path (core/fixed_point.h fixed_code_f); the same
    # values as float64 take the FP64 path. Both are exact, so the codes must be equal, on every kind of
    # value: in range, saturating, ties, tiny, inf and NaN.
    torch.manual_seed(3)
    il, fl = fmt
    x = torch.cat([torch.randn(50000) * 2.0 ** (il - 2), torch.randn(50000) * 2.0 ** -fl,
                   (torch.randint(-2 ** 12, 2 ** 12, (20000,)).float() + 0.5) * 2.0 ** -fl,  # ties
                   torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 3e38, -3e38, 1e-45])]).to(device)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        xs = x.to(dtype)
        fast = fxp.encode(xs, il, fl, rounding=rounding, seed=5, offset=17)
        exact = fxp.encode(xs.double(), il, fl, rounding=rounding, seed=5, offset=17)
        assert torch.equal(fast, exact), (dtype, fmt, rounding)


def test_linear_stochastic_calls_draw_fresh_bits_and_replay_from_the_count():
    # Each forward call rounds under keys derived from (seed, call, role): two calls on the same input
    # differ, a layer restored to call 0 replays the first, and another seed draws other bits.
    torch.manual_seed(1)
    x = torch.randn(64, 32) * 0.3
    make = lambda seed: fxp.FixedPointLinear(32, 48, (4, 8), rounding="stochastic", seed=seed)  # noqa: E731
    layer = make(5)
    state = {k: v.clone() for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)}
    first, second = layer(x).detach(), layer(x).detach()
    assert not torch.equal(first, second)
    replay = make(5)
    replay.load_state_dict({**layer.state_dict(), **state, "_extra_state": {"calls": 0, "seed": 5}})
    assert torch.equal(replay(x).detach(), first)
    other = make(6)
    other.load_state_dict({**layer.state_dict(), **state, "_extra_state": {"calls": 0, "seed": 6}})
    assert not torch.equal(other(x).detach(), first)


@pytest.mark.parametrize("reentrant", [False, True])
def test_linear_under_activation_checkpointing_counts_the_recompute_as_a_call(reentrant):
    # The recompute is a call of its own (README): after one checkpointed forward and backward the count is
    # 2, and the next forward draws as call 2. The non-reentrant recompute stops early, inside the function;
    # the count once advanced after it, so the recompute left call 1 to the next forward, which drew its bits
    # again.
    torch.manual_seed(2)
    layer = fxp.FixedPointLinear(16, 8, (4, 8), rounding="stochastic", seed=3)
    twin = copy.deepcopy(layer)
    x = torch.randn(5, 16, requires_grad=True)
    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=reentrant).sum().backward()
    assert layer.calls == 2
    after = layer(x).detach()
    twin.calls = 2
    assert torch.equal(after, twin(x).detach())
    twin.calls = 1
    assert not torch.equal(after, twin(x).detach())


def test_linear_loads_an_nn_linear_state_dict_onto_its_grid():
    # A float model's weights, to train on in fixed point: strict loading once failed on the missing call
    # count; the layer keeps its count and seed, and holds the weights converted to fmt (to nearest)
    torch.manual_seed(3)
    ref = torch.nn.Linear(6, 3)
    layer = fxp.FixedPointLinear(6, 3, (4, 8), rounding="nearest", seed=4)
    layer(torch.randn(2, 6))
    layer.load_state_dict(ref.state_dict())
    assert (layer.calls, layer.seed) == (1, 4)
    for name in ("weight", "bias"):
        want = fxp.quantize(getattr(ref, name).detach(), 4, 8)
        assert torch.equal(getattr(layer, name).detach(), want) and not torch.equal(want, getattr(ref, name).detach())
    saved = layer.state_dict()  # its own state dict: count and seed come back, the values as they are
    other = fxp.FixedPointLinear(6, 3, (4, 8), rounding="nearest", seed=9)
    other.load_state_dict(saved)
    assert (other.calls, other.seed) == (1, 4) and torch.equal(other.weight, layer.weight)
    with pytest.raises(RuntimeError, match="Missing key.*bias"):
        fxp.FixedPointLinear(6, 3, (4, 8)).load_state_dict({"weight": ref.weight})
    # assign=True: the layer's Parameters would be the caller's tensors; they are rounded into new ones
    source = {k: v.clone() for k, v in ref.state_dict().items()}
    kept = {k: v.clone() for k, v in source.items()}
    assigned = fxp.FixedPointLinear(6, 3, (4, 8), rounding="nearest")
    assigned.load_state_dict(source, assign=True)
    assert all(torch.equal(source[k], kept[k]) for k in source)
    assert torch.equal(assigned.weight.detach(), fxp.quantize(kept["weight"], 4, 8))
    assert isinstance(assigned.weight, torch.nn.Parameter) and assigned.weight.requires_grad


def test_jit_trace_takes_the_roundings():
    """torch.jit.trace gives x.numel() as a 0-d tensor: the offset's range check compared it with 2**64 and
    raised OverflowError, so nothing that rounds stochastically or quantizes could be traced."""
    import warnings
    x = torch.randn(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        sr = torch.jit.trace(lambda t: mpfused.round_stochastic(t, torch.bfloat16, seed=1, offset=5), (x,))
        q = torch.jit.trace(lambda t: fxp.quantize(t, 4, 8, rounding="stochastic", seed=2), (x,))
        layer = fxp.FixedPointLinear(8, 3, (4, 8), rounding="nearest")
        traced = torch.jit.trace(layer, (x.view(1, 8),), check_trace=False)  # (its call count is a constant)
    y = torch.randn(8)
    assert torch.equal(sr(y), mpfused.round_stochastic(y, torch.bfloat16, seed=1, offset=5))
    assert torch.equal(q(y), fxp.quantize(y, 4, 8, rounding="stochastic", seed=2))
    assert torch.equal(traced(y.view(1, 8)), layer(y.view(1, 8)))


def test_a_batch_too_large_for_the_weight_gradients_sum_is_refused_in_forward():
    """The weight gradient is an exact int64 MACC over the input's rows: with 24-bit words at most 2**16 rows.
    The forward took 70,000 rows and the backward raised; now the forward refuses them, naming the limit,
    and a forward that needs no gradient takes them."""
    layer = fxp.FixedPointLinear(4, 3, (8, 16))
    with pytest.raises(ValueError, match=r"at most 2\*\*16 rows a call .* got 70000"):
        layer(torch.randn(70_000, 4, requires_grad=True))
    assert layer.calls == 0
    layer(torch.randn(2**16, 4, requires_grad=True)).sum().backward()  # the limit itself
    with torch.no_grad():
        assert layer(torch.randn(70_000, 4)).shape == (70_000, 3)


@pytest.mark.parametrize("bad", [dict(calls=-7, seed=3), dict(calls=2.9, seed=3), dict(calls=1, seed=2**64 + 3),
                                 dict(calls=1, seed="12"), "not a dict"])
def test_a_saved_state_with_a_bad_count_or_seed_is_refused_before_loading(bad):
    """A seed past 2**64 drew the bits of the seed modulo 2**64 (another layer's), a count of -7 wrapped:
    both were taken in silence. Now refused as the constructor refuses them, before the weights load."""
    layer = fxp.FixedPointLinear(4, 3, (4, 8))
    sd, before = layer.state_dict(), layer.weight.detach().clone()
    sd["weight"], sd["_extra_state"] = torch.zeros_like(sd["weight"]), bad
    with pytest.raises((ValueError, TypeError)):
        layer.load_state_dict(sd)
    assert torch.equal(layer.weight, before) and layer.calls == 0


def test_a_load_that_fails_on_a_tensor_keeps_the_call_count_and_seed():
    """torch's load copies what fits and then raises for a size mismatch; the saved count and seed were taken
    too, so the layer drew another stream's bits after the failed load."""
    layer = fxp.FixedPointLinear(4, 3, (4, 8), seed=11)
    layer(torch.randn(2, 4))
    sd = dict(layer.state_dict(), weight=torch.zeros(3, 5), _extra_state=dict(calls=7, seed=9))
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        layer.load_state_dict(sd)
    assert (layer.calls, layer.seed) == (1, 11)


def test_linear_refuses_a_second_derivative():
    """The backward's gradients are MACCs of codes, with no derivative of their own: a gradient penalty through
    it (create_graph=True) raises, where the penalty's term of the weight gradient was dropped in silence."""
    layer = fxp.FixedPointLinear(4, 3, (8, 8), rounding="nearest")
    x = torch.randn(2, 4, requires_grad=True)
    y = layer(x)
    gx, = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (y.sum() + gx.square().sum()).backward()


def test_weights_of_another_format_are_loaded_onto_this_layers_grid():
    """A state dict saved by a FixedPointLinear of a finer fmt (it has a call count and seed) loaded its weights
    as they were, off this layer's grid."""
    fine = fxp.FixedPointLinear(4, 3, (4, 12), seed=5)
    coarse = fxp.FixedPointLinear(4, 3, (4, 4))
    coarse.load_state_dict(fine.state_dict())
    assert torch.equal(coarse.weight, fxp.quantize(fine.weight.detach(), 4, 4)) and coarse.seed == 5
    same = fxp.FixedPointLinear(4, 3, (4, 12))
    sd = fine.state_dict()
    same.load_state_dict(sd, assign=True)  # on the grid already: the loaded tensor is the param, as assign says
    assert same.weight.data_ptr() == sd["weight"].data_ptr()


def test_matmul_runs_under_vmap_with_its_range_check():
    """The codes' range check read a vmap-batched tensor ('Cannot access data pointer'): it reads the tensor
    the batch wraps. Each batch element is the unbatched call's result, and a code out of range is refused."""
    import warnings
    g = torch.Generator().manual_seed(4)
    a = torch.randint(-100, 100, (3, 5, 7), dtype=torch.int16, generator=g)
    b = torch.randint(-100, 100, (7, 4), dtype=torch.int16, generator=g)
    f = lambda x: fxp.matmul(x, b, (4, 8), (4, 8), (8, 8), rounding="stochastic", seed=3)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's note that the op has no batching rule of its own)
        assert torch.equal(torch.func.vmap(f)(a), torch.stack([f(x) for x in a]))
        a[1, 0, 0] = 5000
        with pytest.raises(ValueError, match=r"a_codes must hold codes of <4,8>"):
            torch.func.vmap(f)(a)
