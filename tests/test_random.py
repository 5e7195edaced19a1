"""mpfused.round_stochastic and the Philox generator behind it (csrc/core/philox.h, core/stochastic.h).

The exact per-value probabilities are checked by the native test (tests/native/test_random.cpp counts,
for each x, how many of the 2^16 random inputs round it up); these tests check the op as users call it:
its distribution over many elements, its keying by (seed, offset + index), and that the bits do not depend
on threads, slices, layouts or the device."""

import math

import numpy as np
import pytest
import torch

import mpfused
from mpfused.random import philox4x32_10, philox_words, round_stochastic
from tolerances import SR_FP16_SUBNORMAL_RESOLUTION, SR_SIGMAS

LOWP = [torch.float16, torch.bfloat16]
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16}

# Random123's published known-answer vectors for Philox4x32-10: counter, key, output.
KATS = [
    ([0, 0, 0, 0], (0, 0), [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, (0xFFFFFFFF, 0xFFFFFFFF), [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], (0xA4093822, 0x299F31D0),
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.sanitize
@pytest.mark.parametrize("kat", KATS, ids=["zeros", "ones", "pi"])
def test_philox_known_answers(device, kat):
    ctr, key, out = kat
    got = philox4x32_10(torch.tensor([ctr], dtype=torch.int64, device=device), key)
    assert got.device.type == device
    assert got.cpu().tolist() == [out]


def reference_words(n: int, seed: int, offset: int, stream=(0, 0)) -> list:
    """The documented mapping, from the raw generator: element e gets 16 bits of block e // 8."""
    first, last = offset // 8, (offset + n - 1) // 8
    ctrs = [[b & 0xFFFFFFFF, b >> 32, stream[0], stream[1]] for b in range(first, last + 1)]
    words = philox4x32_10(ctrs, (seed & 0xFFFFFFFF, seed >> 32)).tolist()
    out = []
    for e in range(offset, offset + n):
        w = words[e // 8 - first][e // 2 % 4]
        out.append(((w >> 16) if e % 2 else (w & 0xFFFF)) << 16)
    return out


@pytest.mark.sanitize
@pytest.mark.parametrize("offset", [0, 3, 8, 2**35 - 5, 8 * 0xFFFFFFFF - 13])
def test_words_follow_the_documented_mapping(device, offset):
    seed = 0x0123456789ABCDEF
    got = philox_words(1000, seed, offset, stream=(7, 1), device=device)
    assert got.cpu().tolist() == reference_words(1000, seed, offset, stream=(7, 1))


def neighbours(x: torch.Tensor, dtype: torch.dtype):
    """(a, b): the largest value of ``dtype`` <= x and the smallest >= x (as float64), for finite x of
    magnitude below the largest finite value."""
    near = x.to(dtype)
    nb = bits(near).to(torch.int32)
    step_up = torch.where(near.double() >= 0, nb + 1, nb - 1)  # one step away from zero
    step_down = torch.where(near.double() > 0, nb - 1, nb + 1)
    step_down = torch.where(near.double() == 0, torch.where(x < 0, torch.full_like(nb, -32767), torch.ones_like(nb)), step_down)
    up = step_up.to(torch.int16).view(dtype).double()
    down = step_down.to(torch.int16).view(dtype).double()
    nd = near.double()
    xd = x.double()
    a = torch.where(nd <= xd, nd, torch.minimum(up, down))
    b = torch.where(nd >= xd, nd, torch.maximum(up, down))
    return a, b


@pytest.mark.parametrize("dtype", LOWP)
def test_representable_values_pass_through(device, dtype):
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = every[torch.isfinite(every.float())]
    x = finite.float().to(device)
    y = round_stochastic(x, dtype, seed=5)
    assert torch.equal(bits(y).cpu(), bits(finite))


# (value, dtype): normal values, both signs, subnormal targets and an FP32 subnormal input.
SAMPLES = [
    (1.0 + 2.0**-12, torch.float16), (-3.3, torch.float16), (0.1, torch.float16), (3.0e-8, torch.float16),
    (-1.0e-6, torch.float16), (2.0**-20 * 1.3, torch.float16),
    (1.0 + 2.0**-12, torch.bfloat16), (-3.3, torch.bfloat16), (1.0e-40, torch.bfloat16), (7.7e37, torch.bfloat16),
]


@pytest.mark.parametrize("value,dtype", SAMPLES, ids=[f"{v:g}-{str(d)[6:]}" for v, d in SAMPLES])
def test_rounds_up_with_probability_of_the_distance(device, value, dtype):
    n = 1 << 16
    x = torch.full((n,), value, dtype=torch.float32, device=device)
    y = round_stochastic(x, dtype, seed=1234, offset=99).double().cpu()
    a, b = (t[0].item() for t in neighbours(x[:1].cpu(), dtype))
    assert a < b, "the sample must lie between two grid values"
    assert bool(((y == a) | (y == b)).all()), "every result is one of the two neighbours"
    xv = float(torch.tensor(value, dtype=torch.float32))
    p = (xv - a) / (b - a)
    frac = (y == b).double().mean().item()
    slack = SR_SIGMAS * math.sqrt(p * (1 - p) / n)
    if dtype == torch.float16 and abs(xv) < 2.0**-14:
        slack += SR_FP16_SUBNORMAL_RESOLUTION
    assert abs(frac - p) <= slack, f"rounded up {frac:.5f} of the time, expected {p:.5f} +- {slack:.5f}"
    # Unbiased: the mean is x, to the same statistical bound (scaled by the step).
    assert abs(y.mean().item() - xv) <= slack * (b - a) * 1.0001


def test_round_to_nearest_would_be_biased_where_sr_is_not():
    # A value a quarter of a step above 1: nearest always gives 1, the mean of SR gives the value.
    x = torch.full((1 << 16,), 1.0 + 2.0**-12)
    assert x.to(torch.float16).double().mean().item() == 1.0
    assert abs(round_stochastic(x, torch.float16, seed=0).double().mean().item() - (1 + 2.0**-12)) < 2.0**-16


@pytest.mark.sanitize
def test_overflow_and_specials(device):
    n = 1 << 16
    # FP16: between the largest finite value 65504 and 2^16 the step is 32, and that step is inf.
    x = torch.full((n,), 65504.0 + 8.0, device=device)
    y = round_stochastic(x, torch.float16, seed=3).float().cpu()
    assert bool(((y == 65504.0) | (y == math.inf)).all())
    frac = (y == math.inf).double().mean().item()
    assert abs(frac - 0.25) <= SR_SIGMAS * math.sqrt(0.25 * 0.75 / n)
    for v in (65536.0, 1e30, math.inf):  # at or past inf's step: always inf, with the sign
        for s in (1.0, -1.0):
            out = round_stochastic(torch.full((64,), s * v, device=device), torch.float16, seed=4).float()
            assert bool((out == s * math.inf).all()), (s, v)
    big = torch.full((n,), 3.0e38, device=device)  # between BF16's max (3.3895e38) and 2^128: never past
    yb = round_stochastic(big, torch.bfloat16, seed=5).float().cpu()
    assert bool(torch.isfinite(yb).all())
    nan = round_stochastic(torch.full((16,), math.nan, device=device), torch.bfloat16, seed=1)
    assert bool(torch.isnan(nan.float()).all())
    assert bool(torch.isnan(round_stochastic(torch.full((16,), math.nan, device=device), torch.float16, seed=1).float()).all())
    zeros = round_stochastic(torch.tensor([0.0, -0.0], device=device), torch.float16, seed=1)
    assert bits(zeros).cpu().tolist() == [0, -32768]


def sr_bits_reference(u: np.ndarray, r: np.ndarray, dtype) -> np.ndarray:
    """core/stochastic.h's rounding rule on FP32 bit patterns u with the random values r (philox_words), in
    numpy integer arithmetic: the definition the vector paths (and the GPU) must reproduce bit for bit."""
    u = u.astype(np.uint32)
    r16 = r.astype(np.uint32) >> np.uint32(16)
    a = u & np.uint32(0x7FFFFFFF)
    nan = a > np.uint32(0x7F800000)
    if dtype == torch.bfloat16:  # the 16 random bits added below the kept half
        rounded = (u + r16) >> np.uint32(16)
        return np.where(nan, np.uint32(0x7FC0), rounded & np.uint32(0xFFFF)).astype(np.uint16)
    with np.errstate(over="ignore"):  # the normal range's formula wraps below 2^-14, where it is not used
        t = (a + (r16 >> np.uint32(3))) & np.uint32(0xFFFFE000)  # FP16's 13 dropped bits
        normal = np.minimum((t >> np.uint32(13)) - np.uint32(112 << 10), np.uint32(0x7C00))
    # the subnormal grid: |x| in units of 2^-40 (truncated), plus the 16 random bits, in whole 2^-24 steps
    clamped = np.minimum(a, np.uint32(0x38800000)).view(np.float32)
    n40 = (clamped * np.float32(2.0**40)).astype(np.int64).astype(np.uint32)
    sub = (n40 + r16) >> np.uint32(16)
    mag = np.where(a >= np.uint32(0x38800000), normal, sub)
    mag = np.where(nan, np.uint32(0x7E00), mag)
    return (((u >> np.uint32(16)) & np.uint32(0x8000)) | mag).astype(np.uint16)


def every_kind_of_input(n: int) -> np.ndarray:
    """FP32 bit patterns: uniform over all patterns (every exponent, NaNs with payloads, both signs), and
    concentrated where the rules change: FP16's subnormal grid and its smallest normals, the binade below
    FP16's overflow and past it, BF16's largest binade and infinities, zeros."""
    g = np.random.default_rng(7)
    pieces = [g.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)]
    for lo, hi in ((0x33000000, 0x38800000), (0x38800000, 0x39000000), (0x477FE000, 0x47800400),
                   (0x7F7F0000, 0x7F800000)):
        mag = g.integers(lo, hi, n, dtype=np.uint64).astype(np.uint32)
        pieces.append(mag | (g.integers(0, 2, n, dtype=np.uint64).astype(np.uint32) << np.uint32(31)))
    pieces.append(np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF, 0x7F800001, 0x38800000,
                            0x387FFFFF, 0x477FE000, 0x47800000], dtype=np.uint32))
    mixed = np.concatenate(pieces)
    return mixed[g.permutation(mixed.size)]


# The carry offsets: one pass of the avx512 (32 blocks) and avx2 (16 blocks) paths starts at the last block
# index whose pass still fits below the carry (2^32 - 32, 2^32 - 16), and one at the first that does not.
CARRY_OFFSETS = [8 * 2**32 - 2000, 8 * 2**32 - 2005, 8 * (2**32 - 32) - 256, 8 * (2**32 - 31) - 256]


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("offset", [0, 3, *CARRY_OFFSETS, 2**64 - 8 * 2**30])
def test_bits_follow_the_rounding_rule_on_every_kind_of_input(device, dtype, offset):
    """Bit for bit against the rule in numpy, on every class of input, for lengths that end mid-vector and
    offsets that start mid-block or put a carry of the block index inside the tensor (the vector paths hand
    such a pass to the scalar generator)."""
    u = every_kind_of_input(1213)
    n = min(u.size, 2**64 - offset)
    u = u[:n]
    x = torch.from_numpy(u.view(np.int32).copy()).view(torch.float32).to(device)
    got = bits(round_stochastic(x, dtype, seed=0x9E3779B97F4A7C15, offset=offset)).cpu().numpy().view(np.uint16)
    r = philox_words(n, 0x9E3779B97F4A7C15, offset, device=device).cpu().numpy().astype(np.uint32)
    want = sr_bits_reference(u, r, dtype)
    wrong = np.flatnonzero(got != want)
    assert wrong.size == 0, [(hex(int(u[i])), hex(int(r[i])), hex(int(got[i])), hex(int(want[i]))) for i in wrong[:5]]


def fp16_shortcut_inputs() -> np.ndarray:
    """FP32 bit patterns for the FP16 shortcut of the optimizers' stochastic write-back on the vector paths,
    which takes a vector of 32 (avx512) or 16 (avx2) values through the normal-range formula alone when
    none of them is below 2^-14 or NaN (tests/test_optim_precision.py): first
    only such values (FP16's normal range from its smallest normal 2^-14 up, the binade where it
    overflows, past it, FP32's largest values and inf, both signs), then the same with one value that
    needs the full path (a tiny value, an FP16 subnormal, zero, a NaN) in every stretch of 96, at a
    different place in each. A vector that fails the check sends the next ones to the full path unchecked
    (ShortcutState in philox_blocks.inc); with two or more clean vectors between two spikes, the check
    looks at nearly every spiked vector."""
    g = np.random.default_rng(11)
    plain = np.concatenate([g.integers(lo, hi, 2048, dtype=np.uint64).astype(np.uint32)
                            for lo, hi in ((0x38800000, 0x39000000), (0x38800000, 0x47800000),
                                           (0x477FE000, 0x47800400), (0x7F7FF000, 0x7F800001))])
    plain |= g.integers(0, 2, plain.size, dtype=np.uint64).astype(np.uint32) << np.uint32(31)
    plain = plain[g.permutation(plain.size)]
    # NaNs with payload bits above the 13 that the shortcut's add would carry out of: a check that let one
    # through would flip its sign
    fixed = np.array([0x387FFFFF, 0x33800000, 0x00000001, 0x80000000, 0x7FC00000, 0xFF800001, 0x7FFFFFFF,
                      0x7F802000, 0xFFBFE000], dtype=np.uint32)
    spiked = plain.copy()
    for k, start in enumerate(range(0, spiked.size - 95, 96)):
        # one in three a fixed special; the rest tiny: half in the binade just below 2^-14, half lower
        lo = 0x38000000 if k % 3 == 1 else 0x33000000
        tiny = np.uint32(g.integers(lo, 0x38800000)) | (np.uint32(k % 2) << np.uint32(31))
        spiked[start + (k * 37) % 96] = fixed[(k // 3) % fixed.size] if k % 3 == 0 else tiny
    return np.concatenate([plain, spiked])


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("k", [1, 7, 8, 13, 4096, 100001])
def test_a_slice_with_its_offset_gives_the_same_bits(device, dtype, k):
    torch.manual_seed(0)
    x = torch.randn(200003, device=device) * 1e-3
    whole = round_stochastic(x, dtype, seed=77)
    part = round_stochastic(x[k:], dtype, seed=77, offset=k)
    assert torch.equal(bits(part), bits(whole[k:]))
    shifted = round_stochastic(x[k:], dtype, seed=77, offset=k + 1)
    assert not torch.equal(bits(shifted), bits(whole[k:])), "the offset must key the bits"


@pytest.mark.parametrize("dtype", LOWP)
def test_same_bits_for_every_thread_count_and_layout(dtype):
    torch.manual_seed(1)
    x = torch.randn(3, 300007) * 1e-2
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(bits(round_stochastic(x, dtype, seed=9)))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    xt = x.t().contiguous().t()  # the same values, column-major: indexed in row-major order all the same
    assert torch.equal(bits(round_stochastic(xt, dtype, seed=9)), outs[0])


def test_seed_keys_the_bits():
    x = torch.randn(4096) * 1e-3
    a = bits(round_stochastic(x, torch.bfloat16, seed=1))
    assert torch.equal(a, bits(round_stochastic(x, torch.bfloat16, seed=1)))
    assert not torch.equal(a, bits(round_stochastic(x, torch.bfloat16, seed=2)))
    assert not torch.equal(a, bits(round_stochastic(x, torch.bfloat16, seed=1 + 2**32))), "the seed's high word counts"


@pytest.mark.sanitize
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOWP)
def test_cuda_gives_the_cpu_bits(dtype):
    from conftest import cuda_skip_reason
    if cuda_skip_reason():
        pytest.skip(cuda_skip_reason())
    torch.manual_seed(2)
    x = torch.cat([torch.randn(1 << 20) * 10.0 ** e for e in range(-9, 6)])
    x[::1001] = math.inf
    x[5::1001] = -1e38
    for offset, sl in ((0, slice(None)), (5, slice(5, None)), (3, slice(3, -3)), (0, slice(0, -3)),
                       (8, slice(8, None))):  # unaligned starts; the aligned path with a ragged tail; and
                                             # an aligned start past element 0
        cpu = round_stochastic(x[sl], dtype, seed=2**63 + 5, offset=offset)
        gpu = round_stochastic(x[sl].cuda(), dtype, seed=2**63 + 5, offset=offset)
        assert torch.equal(bits(gpu).cpu(), bits(cpu))
    w_cpu = philox_words(100003, 11, 2**40 + 3, stream=(1, 2))
    w_gpu = philox_words(100003, 11, 2**40 + 3, stream=(1, 2), device="cuda")
    assert torch.equal(w_gpu.cpu(), w_cpu)


def test_out_argument(device):
    x = torch.randn(1000, device=device)
    out = torch.empty(1000, dtype=torch.bfloat16, device=device)
    r = round_stochastic(x, torch.bfloat16, seed=3, out=out)
    assert r is out or r.data_ptr() == out.data_ptr()
    assert torch.equal(bits(out), bits(round_stochastic(x, torch.bfloat16, seed=3)))


def test_bad_input_raises_before_anything_is_written():
    x = torch.randn(16)
    sentinel = lambda dtype, n=16: torch.full((n,), 7.0).to(dtype)  # noqa: E731
    good_out = sentinel(torch.float16)
    cases = [  # (kwargs, the out tensor passed (checked unchanged) or None, exception, message)
        (dict(x=x.double(), dtype=torch.float16, seed=0, out=good_out), good_out, ValueError, "x must be a float32"),
        (dict(x=x, dtype=torch.float32, seed=0), None, ValueError, "dtype must be torch.float16 or torch.bfloat16"),
        (dict(x=x, dtype="float16", seed=0), None, TypeError, "dtype"),
        (dict(x=x.tolist(), dtype=torch.float16, seed=0), None, TypeError, "x must be"),
        (dict(x=x, dtype=torch.float16, seed=-1, out=good_out), good_out, ValueError, "seed must be in"),
        (dict(x=x, dtype=torch.float16, seed=2**64, out=good_out), good_out, ValueError, "seed must be in"),
        (dict(x=x, dtype=torch.float16, seed=1.5), None, TypeError, "seed must be a Python int"),
        (dict(x=x, dtype=torch.float16, seed=torch.tensor(3)), None, TypeError, "seed must be a Python int"),
        (dict(x=x, dtype=torch.float16, seed=0, offset=2**64 - 15, out=good_out), good_out, ValueError,
         "offset \\+ numel"),
        (dict(x=x, dtype=torch.float16, seed=0, offset=-1), None, ValueError, "offset must be in"),
    ]
    for dtype, n, msg in ((torch.bfloat16, 16, "out must be"), (torch.float16, 15, "out must be")):
        bad = sentinel(dtype, n)
        cases.append((dict(x=x, dtype=torch.float16, seed=0, out=bad), bad, ValueError, msg))
    strided = sentinel(torch.float16, 32)
    cases.append((dict(x=x, dtype=torch.float16, seed=0, out=strided[::2]), strided, ValueError, "contiguous"))
    for kwargs, target, exc, msg in cases:
        before = None if target is None else target.clone()
        with pytest.raises(exc, match=msg):
            round_stochastic(**kwargs)
        if target is not None:
            assert torch.equal(target.view(torch.int16), before.view(torch.int16)), msg
    shared = torch.zeros(32)  # out inside x's memory
    with pytest.raises(ValueError, match="overlap"):
        round_stochastic(shared[8:], torch.float16, seed=0, out=shared[:12].view(torch.float16))
    with pytest.raises(ValueError, match="numel must be"):
        philox_words(-1, 0)
    with pytest.raises(ValueError, match="stream must be"):
        philox_words(4, 0, stream=(2**32, 0))
    with pytest.raises(ValueError, match="key must be"):
        philox4x32_10([[0, 0, 0, 0]], (0, -1))


def test_the_last_index_of_a_stream_is_usable(device):
    # offset + numel == 2^64: the last element takes index 2^64 - 1; one more is an error.
    x = torch.full((5,), 1.0 + 2.0**-12, device=device)
    y = round_stochastic(x, torch.float16, seed=1, offset=2**64 - 5)
    words = philox_words(5, 1, 2**64 - 5, device=device)
    assert words.cpu().tolist() == reference_words(5, 1, 2**64 - 5)
    up = (words.cpu() >> 19) >= 2**13 - 2**11  # x = 1 + 2^-12: 2^11 in FP16's 13 dropped bits
    assert y.cpu().float().tolist() == [1.0 + 2.0**-10 if u else 1.0 for u in up.tolist()]
    with pytest.raises(ValueError, match="offset"):
        round_stochastic(x, torch.float16, seed=1, offset=2**64 - 4)


def test_empty_and_top_level_export():
    assert mpfused.round_stochastic is round_stochastic
    e = round_stochastic(torch.empty(0, 3), torch.float16, seed=0, offset=2**64 - 1)
    assert e.shape == (0, 3) and e.dtype == torch.float16


def test_philox_counters_on_meta_are_refused_by_name():
    """A meta tensor's words cannot be range-checked: the check itself raised torch's internal error."""
    with pytest.raises(ValueError, match="counters must be on the CPU or a CUDA device, got a tensor on meta"):
        mpfused.random.philox4x32_10(torch.zeros(2, 4, dtype=torch.int64, device="meta"), (0, 0))


def test_philox_counters_given_as_lists_are_words_or_refused():
    """A list's 1.5 was truncated to the word 1 (the list became an int64 tensor), where a float tensor is
    refused; a value past int64 gave torch's "Overflow when unpacking long"."""
    words = mpfused.random.philox4x32_10([[1, 2, 3, 4]], (0, 0))
    assert torch.equal(words, mpfused.random.philox4x32_10(torch.tensor([[1, 2, 3, 4]]), (0, 0)))
    np = pytest.importorskip("numpy")
    for good in (np.array([[1, 2, 3, 4]], dtype=np.uint64), [[np.uint64(1), 2, 3, 4]], [[np.int32(1), 2, 3, 4]]):
        assert torch.equal(mpfused.random.philox4x32_10(good, (0, 0)), words)
    for bad, match in [([[1.5, 2, 3, 4]], "integer words, got torch.float32"), ([[1, 2, 3, 2**70]], "Overflow"),
                       ([[1, 2, 3, "4"]], r"words in \[0, 2\*\*32\)"), ([[1, 2, 3, 2**32]], r"words in \[0, 2\*\*32\)")]:
        with pytest.raises(ValueError, match=match):
            mpfused.random.philox4x32_10(bad, (0, 0))


def test_philox_takes_uint32_counters():
    """uint32 is the natural dtype of Philox words: the range check raised NotImplementedError ('lt_cpu' not
    implemented for 'UInt32')."""
    words = [[1, 2, 3, 2**32 - 1], [0, 0, 0, 0]]
    as_u32 = mpfused.random.philox4x32_10(torch.tensor(words, dtype=torch.int64).to(torch.uint32), (7, 9))
    assert torch.equal(as_u32, mpfused.random.philox4x32_10(words, (7, 9)))
    with pytest.raises(ValueError, match="not uint64"):
        mpfused.random.philox4x32_10(torch.zeros(1, 4, dtype=torch.uint64), (0, 0))
