"""The multi-tensor overflow reduction against plain torch references."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mpfused
from mpfused._ops import overflow_limits
from conftest import requires_cuda
from tolerances import NORM_ULP, SUMSQ_RTOL

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BAD_VALUES = [float("nan"), float("inf"), float("-inf")]
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def flag(device, value=0.0):
    return torch.full((1,), value, dtype=torch.float32, device=device)


def ulp32(x):
    """The spacing of FP32 values at |x|."""
    return float(np.spacing(np.float32(abs(x))))


def ref_sumsq(tensors, inv_scale=1.0):
    return sum(float((t.double() * inv_scale).square().sum()) for t in tensors)


def assert_bitwise_equal(actual, expected):
    """Bitwise equality for every non-NaN element; NaN exactly where the reference has NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a_nan, e_nan = actual.isnan(), expected.isnan()
    assert torch.equal(a_nan, e_nan)
    view = INT_VIEW[actual.dtype]
    assert torch.equal(actual[~a_nan].view(view), expected[~e_nan].view(view))


# ---- detection --------------------------------------------------------------------------------------
def boundary_positions(numel, chunk):
    positions = {0, numel - 1}
    for k in range(chunk, numel, chunk):
        positions |= {k - 1, k}
    return sorted(positions)


# The check alone, and with a sum of squares (the CPU's FP16 sum-of-squares loop finds non-finite
# values through the sums and then reads the span again for the flag).
CHECK_MODES = {"check": lambda d: {}, "sumsq": lambda d: dict(sumsq=flag(d)),
               "scaled-sumsq": lambda d: dict(inv_scale=flag(d, 1.0 / 1024), sumsq=flag(d))}


@pytest.mark.sanitize
@pytest.mark.parametrize("mode", list(CHECK_MODES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", BAD_VALUES, ids=["nan", "+inf", "-inf"])
def test_detects_at_first_last_and_both_sides_of_every_chunk_boundary(device, dtype, bad, mode):
    chunk = overflow_limits(device)["chunk_size"]
    numel = 3 * chunk + 17
    clean = torch.randn(numel, device=device).to(dtype)
    positions = boundary_positions(numel, chunk)
    assert len(positions) == 8
    for pos in positions:
        t = clean.clone()
        t[pos] = bad
        found = flag(device)
        mpfused.non_finite_check_([torch.randn(5, device=device).to(dtype), t], found, **CHECK_MODES[mode](device))
        assert found.item() == 1.0, f"{bad} at {pos} of {numel} not found"
    found = flag(device)
    mpfused.non_finite_check_([clean], found, **CHECK_MODES[mode](device))
    assert found.item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sum_of_squares_that_overflows_from_finite_values_is_not_a_found_inf(device, dtype):
    # Finite values whose scaled squares overflow FP32: the sum is inf, the flag stays clear. Then one
    # NaN among them: the flag is set.
    t = torch.full((3 * 4096 + 5,), 1000.0, dtype=dtype, device=device)
    inv = flag(device, 2.0**60)  # 1000 * 2^60 is finite in FP32; its square is not
    found, sumsq = flag(device), flag(device)
    mpfused.non_finite_check_([t], found, inv, sumsq=sumsq)
    assert found.item() == 0.0
    assert sumsq.item() == math.inf
    t[4097] = float("nan")
    mpfused.non_finite_check_([t], found, inv, sumsq=sumsq, overwrite=True)
    assert found.item() == 1.0
    assert math.isnan(sumsq.item())


@pytest.mark.parametrize("dtype", DTYPES)
def test_largest_finite_values_are_not_flagged(device, dtype):
    info = torch.finfo(dtype)
    t = torch.tensor([info.max, -info.max, info.tiny, -info.tiny, 0.0, -0.0], dtype=dtype, device=device)
    if dtype != torch.bfloat16:
        t = torch.cat([t, torch.tensor([info.smallest_normal / 4], dtype=dtype, device=device)])  # subnormal
    found = flag(device)
    mpfused.non_finite_check_([t], found)
    assert found.item() == 0.0


def test_flag_already_set_stays_set(device):
    clean = [torch.randn(1000, device=device)]
    for initial in (1.0, 2.0):
        found = flag(device, initial)
        mpfused.non_finite_check_(clean, found)
        assert found.item() == initial


@pytest.mark.sanitize
def test_bad_tensor_in_a_later_launch_of_a_long_list(device):
    lim = overflow_limits(device)
    n = min(lim["max_tensors"], 1000) * 2 + 3  # beyond one launch's tensor capacity on CUDA
    tensors = [torch.randn(37 + i % 5, device=device, dtype=DTYPES[i % 3]) for i in range(n)]
    found = flag(device)
    mpfused.non_finite_check_(tensors, found)
    assert found.item() == 0.0
    tensors[-2][-1] = float("inf")
    mpfused.non_finite_check_(tensors, found)
    assert found.item() == 1.0


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", DTYPES)
def test_list_of_many_chunks_and_partial_chunks(device, dtype):
    """40 work items: full chunks and one-element tails. (A launch holds 2^30 chunks on CUDA, 2^46 elements:
    no GPU holds a list that needs a second launch for its chunks, so that split is tested by the plan's
    native tests with small limits, tests/native/test_plan.cpp; the tensor-count split, which lists do
    reach, by test_bad_tensor_in_a_later_launch_of_a_long_list.)"""
    chunk = overflow_limits(device)["chunk_size"]
    items = 40
    tensors = [torch.randn(chunk + 1, device=device).to(dtype) for _ in range((items + 1) // 2)]
    tensors[-1][chunk] = float("nan")  # the last element of the last chunk of the last launch
    found, sumsq = flag(device), flag(device)
    mpfused.non_finite_check_(tensors[:-1], found, sumsq=sumsq)
    assert found.item() == 0.0
    assert sumsq.item() == pytest.approx(ref_sumsq(tensors[:-1]), rel=SUMSQ_RTOL[dtype])
    mpfused.non_finite_check_(tensors, found)
    assert found.item() == 1.0


@requires_cuda
@pytest.mark.big
def test_cuda_tensor_beyond_2_to_the_31_elements():
    """One FP16 tensor of 2^31 + 70,001 elements (4 GiB; int32 element indices would wrap): an inf in its
    last element is found, and the sum of squares counts every element once."""
    numel = 2**31 + 70_001
    need = numel * 2 + (256 << 20)  # the tensor and room for the kernel's workspace
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory, this GPU has {free / 2**30:.1f} GiB free")
    t = torch.full((numel,), 0.5, dtype=torch.float16, device="cuda")
    found, sumsq = flag("cuda"), flag("cuda")
    mpfused.non_finite_check_([t], found, sumsq=sumsq)
    assert found.item() == 0.0
    assert sumsq.item() == pytest.approx(numel * 0.25, rel=SUMSQ_RTOL[torch.float16])
    t[-1] = float("inf")
    mpfused.non_finite_check_([t], found)
    assert found.item() == 1.0
    t[-1] = 0.5
    t[2**31 + 3] = float("nan")  # past the int32 range, not at the end
    found.zero_()
    mpfused.non_finite_check_([t], found)
    assert found.item() == 1.0


# ---- sum of squares ---------------------------------------------------------------------------------
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", DTYPES)
def test_sumsq_matches_float64(device, dtype):
    torch.manual_seed(0)
    tensors = [(torch.randn(n, device=device) * s).to(dtype) for n, s in [(1, 3.0), (1000, 1e-3), (70001, 1.0), (200000, 20.0)]]
    found, sumsq = flag(device), flag(device)
    mpfused.non_finite_check_(tensors, found, sumsq=sumsq)
    assert found.item() == 0.0
    assert sumsq.item() == pytest.approx(ref_sumsq(tensors), rel=SUMSQ_RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_tensors_every_position_and_exact_lane_sums(dtype):
    """CPU, tensors of 1 to 40 elements (fewer than its 32 lanes go one by one, in scalar code; the rest
    through the lanes): a non-finite value is found at every position in every mode, the unscaled values
    are torch's multiply bit for bit, and the sum of squares is bit for bit the lanes' (element i in lane
    i % 32, each lane's squares added in order, then the lanes in order, all in FP32)."""
    inv = 2.0**-3
    for n in range(1, 41):
        x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 8).to(dtype)
        v = (x.float() * inv).numpy()
        lanes = np.zeros(32, dtype=np.float32)
        for i in range(n):
            lanes[i % 32] = np.float32(lanes[i % 32] + np.float32(v[i] * v[i]))
        want = np.float32(0)
        for lane in lanes:
            want = np.float32(want + lane)
        for unscale in (False, True):
            t, found, sumsq = x.clone(), flag("cpu"), flag("cpu")
            mpfused.non_finite_check_([t], found, torch.tensor([inv]), unscale=unscale, sumsq=sumsq)
            assert found.item() == 0.0
            assert np.float32(sumsq.item()).view(np.int32) == want.view(np.int32), (n, unscale)
            assert_bitwise_equal(t, (x.float() * inv).to(dtype) if unscale else x)
        for pos in range(n):
            for bad, mode in zip(BAD_VALUES, ("check", "sumsq", "scaled-sumsq")):
                t = x.clone()
                t[pos] = bad
                found = flag("cpu")
                mpfused.non_finite_check_([t], found, **CHECK_MODES[mode]("cpu"))
                assert found.item() == 1.0, (n, pos, mode)
            t = x.clone()
            t[pos] = BAD_VALUES[pos % 3]
            found = flag("cpu")
            mpfused.non_finite_check_([t], found, torch.tensor([inv]), unscale=True)
            assert found.item() == 1.0, (n, pos, "unscale")


def test_sumsq_mixed_dtypes_with_inv_scale_accumulates(device):
    torch.manual_seed(1)
    tensors = [torch.randn(3000 + i, device=device).to(DTYPES[i % 3]) * 512 for i in range(9)]
    inv = torch.tensor([1.0 / 512], device=device)
    found, sumsq = flag(device), flag(device, 5.0)  # sumsq is accumulated into
    mpfused.non_finite_check_(tensors, found, inv, sumsq=sumsq)
    expected = 5.0 + ref_sumsq(tensors, 1.0 / 512)
    assert sumsq.item() == pytest.approx(expected, rel=SUMSQ_RTOL[torch.float32])
    assert all(t.abs().max() > 10 for t in tensors), "the tensors themselves must not be unscaled"


def test_sumsq_of_unscaled_values_does_not_overflow(device):
    # Scaled FP32 gradients whose squares overflow FP32: the norm of the unscaled values is finite.
    t = torch.full((4096,), 1e30, device=device)
    found, sumsq = flag(device), flag(device)
    mpfused.non_finite_check_([t], found, torch.tensor([1e-20], device=device), sumsq=sumsq)
    assert found.item() == 0.0
    assert sumsq.item() == pytest.approx(4096 * 1e20, rel=1e-5)


def test_sumsq_is_deterministic_across_thread_counts():
    torch.manual_seed(2)
    tensors = [torch.randn(300_000).half(), torch.randn(123_457), torch.randn(99_999).bfloat16()]
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            s = flag("cpu")
            mpfused.non_finite_check_(tensors, flag("cpu"), sumsq=s)
            results.append(s.item())
    finally:
        torch.set_num_threads(old)
    assert results[0] == results[1] == results[2]


# ---- unscale ------------------------------------------------------------------------------------------
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inv_scale", [1.0 / 65536, 1.0 / 3, 2.0**-30, 1000.0])
def test_unscale_is_bitwise_torchs_multiply(device, dtype, inv_scale):
    torch.manual_seed(3)
    t = (torch.randn(100_003, device=device) * 300).to(dtype)
    t[::1001] = torch.finfo(dtype).max / 2  # overflow to inf for inv_scale > 2 in FP16
    inv = torch.tensor([inv_scale], device=device)
    expected = (t.float() * inv).to(dtype)
    found = flag(device)
    mpfused.non_finite_check_([t], found, inv, unscale=True)
    assert_bitwise_equal(t, expected)
    assert found.item() == 0.0  # the check is on the values before unscaling


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", DTYPES)
def test_unscale_matches_torch_amp_kernel_with_non_finite_values(device, dtype):
    torch.manual_seed(4)
    grads = [(torch.randn(n, device=device) * 1000).to(dtype) for n in (10, 65536, 65537, 200_000)]
    grads[2][65536] = float("nan")
    grads[3][7] = float("-inf")
    # (torch's CUDA kernel has no BF16 (torch 2.11 raises NotImplementedError): there, its CPU kernel is
    # the reference, on host copies)
    ref_device = "cpu" if dtype == torch.bfloat16 else device
    expected = [g.to(ref_device, copy=True) for g in grads]
    inv = torch.tensor([1.0 / 1024], device=device)
    ref_found = flag(ref_device)
    torch._amp_foreach_non_finite_check_and_unscale_(expected, ref_found, inv.to(ref_device))
    found = flag(device)
    mpfused.non_finite_check_(grads, found, inv, unscale=True)
    assert found.item() == ref_found.item() == 1.0
    for g, e in zip(grads, expected):
        assert_bitwise_equal(g.cpu(), e.cpu())


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 140_000), min_size=0, max_size=6),
    dtype_ids=st.lists(st.integers(0, 2), min_size=6, max_size=6),
    log2_inv=st.integers(-24, 4),
    bad_at=st.one_of(st.none(), st.tuples(st.integers(0, 5), st.floats(0, 1), st.sampled_from(BAD_VALUES))),
)
def test_property_against_torch_reference(sizes, dtype_ids, log2_inv, bad_at):
    gen = torch.Generator().manual_seed(len(sizes) * 7919 + log2_inv)
    tensors = [(torch.randn(n, generator=gen) * 4096).to(DTYPES[d]) for n, d in zip(sizes, dtype_ids)]
    expect_bad = False
    if bad_at is not None and tensors:
        t = tensors[bad_at[0] % len(tensors)]
        if t.numel():
            t[min(int(bad_at[1] * t.numel()), t.numel() - 1)] = bad_at[2]
            expect_bad = True
    inv_scale = 2.0**log2_inv
    expected_sumsq = ref_sumsq(tensors, inv_scale)
    expected = [(t.float() * inv_scale).to(t.dtype) for t in tensors]
    found, sumsq = flag("cpu"), flag("cpu")
    mpfused.non_finite_check_(tensors, found, torch.tensor([inv_scale]), unscale=True, sumsq=sumsq)
    assert found.item() == float(expect_bad)
    if not expect_bad:
        assert sumsq.item() == pytest.approx(expected_sumsq, rel=SUMSQ_RTOL[torch.float32], abs=1e-30)
    else:
        assert not math.isfinite(sumsq.item())
    for t, e in zip(tensors, expected):
        assert_bitwise_equal(t, e)


# ---- bad input -----------------------------------------------------------------------------------------
def test_empty_list_and_empty_tensors_are_no_ops(device):
    found, sumsq = flag(device), flag(device, 3.0)
    mpfused.non_finite_check_([], found, sumsq=sumsq)
    mpfused.non_finite_check_([torch.empty(0, device=device), torch.empty(0, 5, device=device).half()], found, sumsq=sumsq)
    assert found.item() == 0.0 and sumsq.item() == 3.0


@pytest.mark.parametrize("tensors", [[], [0]], ids=["no-tensors", "empty-tensor"])
def test_accumulating_call_with_nothing_to_check_still_writes_the_norm(device, tensors):
    # The norm is sqrt of the sum as it stands, whatever the list holds (it was left unwritten: the torch layer
    # returned early, and the CUDA backend skipped an empty plan; found by the CUDA simulator, tests/native/cuda_sim).
    found, sumsq, norm = flag(device), flag(device, 9.0), flag(device, -1.0)
    mpfused.non_finite_check_([torch.empty(n, device=device) for n in tensors], found, sumsq=sumsq, norm=norm)
    assert (found.item(), sumsq.item(), norm.item()) == (0.0, 9.0, 3.0)


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", DTYPES)
def test_overwrite_mode_replaces_stale_results_and_writes_the_norm(device, dtype):
    tensors = [torch.randn(n, device=device).to(dtype) for n in (3, 70_000, 1000)]
    found, sumsq, norm = flag(device, 1.0), flag(device, 123.0), flag(device, -1.0)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    inv = torch.tensor([0.25], device=device)
    mpfused.non_finite_check_(tensors, found, inv, sumsq=sumsq, overwrite=True, norm=norm, counter=counter)
    expect = sum(float(((t.double() * 0.25) ** 2).sum()) for t in tensors)
    assert found.item() == 0.0  # the stale 1.0 is replaced by this call's result
    assert abs(sumsq.item() - expect) <= SUMSQ_RTOL[dtype] * expect
    # The norm is sqrt(sumsq) rounded once to FP32 (torch's own CPU sqrt is 1 ulp off on some CPUs).
    exact = math.sqrt(sumsq.item())
    assert abs(norm.item() - exact) <= NORM_ULP * ulp32(exact)
    assert counter.item() == 0  # borrowed and left zero
    tensors[1][69_999] = float("nan")
    mpfused.non_finite_check_(tensors, found, inv, sumsq=sumsq, overwrite=True, norm=norm, counter=counter)
    assert found.item() == 1.0 and counter.item() == 0


def test_overwrite_mode_over_several_launches_and_an_empty_list(device):
    # More tensors than one CUDA launch holds: the first launch starts from zero, the others add.
    n = mpfused._ops.overflow_limits("cuda")["max_tensors"] + 5
    tensors = [torch.full((7,), 2.0, device=device) for _ in range(n)]
    found, sumsq, norm = flag(device, 1.0), flag(device, 1e9), flag(device)
    mpfused.non_finite_check_(tensors, found, sumsq=sumsq, overwrite=True, norm=norm)
    assert found.item() == 0.0 and sumsq.item() == 28.0 * n and norm.item() == pytest.approx((28.0 * n) ** 0.5)
    tensors[-1][6] = float("inf")  # in the last launch only
    mpfused.non_finite_check_(tensors, found, sumsq=sumsq, overwrite=True, norm=norm)
    assert found.item() == 1.0
    found, sumsq, norm = flag(device, 1.0), flag(device, 5.0), flag(device, 5.0)
    mpfused.non_finite_check_([], found, sumsq=sumsq, overwrite=True, norm=norm)
    assert (found.item(), sumsq.item(), norm.item()) == (0.0, 0.0, 0.0)


def _bad_calls(device):
    good = torch.randn(8, device=device)
    f = flag(device)
    return [
        (lambda: mpfused.non_finite_check_([good, torch.randn(8, 2, device=device).t()], f), r"tensors\[1\] must be contiguous"),
        (lambda: mpfused.non_finite_check_([good, torch.arange(4, device=device)], f), r"tensors\[1\] must be a float32, float16 or bfloat16"),
        (lambda: mpfused.non_finite_check_([torch.randn(4, dtype=torch.complex64, device=device)], f), r"tensors\[0\] must be a float32"),
        (lambda: mpfused.non_finite_check_([good, torch.randn(4, dtype=torch.float64, device=device)], f), r"tensors\[1\] must be a float32"),
        (lambda: mpfused.non_finite_check_([good.to_sparse()], f), r"tensors\[0\] must be a dense"),
        (lambda: mpfused.non_finite_check_([good, torch.empty(3, device="meta")], f), r"tensors\[1\] is on meta but tensors\[0\] is on"),
        (lambda: mpfused.non_finite_check_([good], torch.zeros(1, dtype=torch.float16, device=device)), r"found_inf must be a float32 tensor with one element"),
        (lambda: mpfused.non_finite_check_([good], torch.zeros(2, device=device)), r"found_inf must be a float32 tensor with one element"),
        (lambda: mpfused.non_finite_check_([good], f, torch.ones(1, device="meta")), r"inv_scale is on meta but tensors\[0\] is on"),
        (lambda: mpfused.non_finite_check_([good], f, sumsq=torch.zeros((), dtype=torch.float64, device=device)), r"sumsq must be a float32"),
        (lambda: mpfused.non_finite_check_([good], f, unscale=True), r"unscale=True needs inv_scale"),
        (lambda: mpfused.non_finite_check_([good], f, norm=flag(device)), r"norm needs sumsq"),
        (lambda: mpfused.non_finite_check_([good], f, counter=torch.zeros(1, device=device)), r"counter must be a zeroed int32"),
    ]


def test_bad_input_raises_a_clear_error_naming_the_argument(device):
    for call, message in _bad_calls(device):
        with pytest.raises(ValueError, match=message):
            call()


def test_a_call_that_fails_writes_nothing(device):
    grads = [torch.full((100,), 1024.0, device=device), torch.full((10,), float("nan"), device=device).half()]
    before = [g.clone() for g in grads]
    found, sumsq = flag(device), flag(device)
    bad_last = torch.randn(4, 4, device=device).t()  # non-contiguous, after tensors that would be written
    with pytest.raises(ValueError, match=r"tensors\[2\]"):
        mpfused.non_finite_check_(grads + [bad_last], found, torch.tensor([0.5], device=device), unscale=True, sumsq=sumsq)
    assert found.item() == 0.0 and sumsq.item() == 0.0
    for g, b in zip(grads, before):
        assert torch.equal(g.isnan(), b.isnan()) and torch.equal(g.nan_to_num(), b.nan_to_num())


def test_outputs_that_share_memory_with_another_argument_are_refused_before_writing(device):
    # found_inf == sumsq left the flag holding the sum (every step then reads as an overflow); a sumsq in a
    # grad's memory corrupted the grad
    g = torch.full((8,), 4.0, device=device)
    buf = torch.zeros(4, device=device)
    cases = [(dict(found_inf=buf[:1], sumsq=buf[:1]), "sumsq must not overlap found_inf"),
             (dict(found_inf=buf[:1], sumsq=buf[1:2], norm=buf[1:2]), "norm must not overlap sumsq"),
             (dict(found_inf=buf[:1], inv_scale=buf[:1], unscale=True), "found_inf must not overlap inv_scale"),
             (dict(found_inf=g[3:4]), r"found_inf must not overlap tensors\[0\]"),
             (dict(found_inf=buf[:1], sumsq=g[:1]), r"sumsq must not overlap tensors\[0\]")]
    for kwargs, message in cases:
        kwargs.setdefault("inv_scale", torch.ones(1, device=device))
        with pytest.raises(ValueError, match=message):
            mpfused.non_finite_check_([g], **kwargs)
        assert torch.equal(g, torch.full((8,), 4.0, device=device)) and not buf.any()


def test_an_unscale_in_place_refuses_tensors_over_inv_scale_or_over_each_other(device):
    """The unscale writes the tensors while it reads inv_scale and them. A tensor over inv_scale's memory
    changed the factor for the tensors after it (on the CPU: [inv, t] unscaled t by 0.5 * 0.5; on CUDA it
    depends on the blocks' order), and two tensors over one memory were unscaled twice (on CUDA once or twice
    as the blocks raced). Both raise before anything is written; a check without the unscale reads them as
    they are."""
    buf = torch.full((16,), 2.0, device=device)
    inv = torch.full((1,), 0.5, device=device)
    found = flag(device)
    cases = [([inv, buf], inv, r"tensors\[0\] must not overlap inv_scale"),
             ([buf[:8], buf[8:]], buf[15:], r"tensors\[1\] must not overlap inv_scale"),
             ([buf, buf], inv, r"tensors\[1\] and tensors\[0\] share memory"),
             ([buf[:9], torch.ones(3, device=device), buf[8:]], inv, r"tensors\[2\] and tensors\[0\] share memory"),
             ([buf[4:], buf[:5]], inv, r"tensors\[1\] and tensors\[0\] share memory")]
    for tensors, inv_scale, message in cases:
        before = [t.clone() for t in tensors]
        with pytest.raises(ValueError, match=message):
            mpfused.non_finite_check_(tensors, found, inv_scale, unscale=True)
        assert all(torch.equal(t, b) for t, b in zip(tensors, before)) and found.item() == 0.0
        assert torch.equal(inv, torch.full((1,), 0.5, device=device))
    # adjacent views do not overlap; and a check alone writes no tensor, so it takes repeats
    mpfused.non_finite_check_([buf[:8], buf[8:]], found, inv, unscale=True)
    assert torch.equal(buf, torch.ones(16, device=device))
    mpfused.non_finite_check_([buf, buf, inv], found)
    assert found.item() == 0.0


def test_tensor_subclasses_raise_type_error_before_anything_is_written(device):
    """A wrapper subclass (DTensor's kind) has no memory the kernel can address: a TypeError, no crash."""
    from torch.testing._internal.two_tensor import TwoTensor

    good = torch.full((10,), 4.0, device=device)
    sub = TwoTensor(torch.randn(4, device=device), torch.randn(4, device=device))
    found = flag(device)
    with pytest.raises(TypeError, match=r"tensors\[1\] is a tensor subclass"):
        mpfused.non_finite_check_([good, sub], found, torch.tensor([0.5], device=device), unscale=True)
    with pytest.raises(TypeError, match=r"found_inf is a tensor subclass"):
        mpfused.non_finite_check_([good], TwoTensor(found, found.clone()))
    assert torch.equal(good, torch.full((10,), 4.0, device=device)) and found.item() == 0.0


def test_wrong_python_types_are_rejected():
    with pytest.raises(TypeError, match="list or tuple of tensors, got a single tensor"):
        mpfused.non_finite_check_(torch.zeros(3), flag("cpu"))
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a tensor"):
        mpfused.non_finite_check_([torch.zeros(3), 3.0], flag("cpu"))


# ---- CUDA-only properties (skipped without a GPU) ------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.profiler
@requires_cuda
def test_cuda_no_host_sync_and_one_launch_per_list():
    tensors = [torch.randn(1000 + i, device="cuda").to(DTYPES[i % 3]) for i in range(200)]
    found, sumsq, inv = flag("cuda"), flag("cuda"), torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            mpfused.non_finite_check_(tensors, found, inv, unscale=True, sumsq=sumsq)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "overflow_kernel" in e.name]
    assert len(kernels) == 1, [e.name for e in kernels]


@pytest.mark.cuda
@pytest.mark.profiler
@requires_cuda
def test_cuda_overwrite_mode_is_one_launch_with_no_memset():
    tensors = [torch.randn(1000 + i, device="cuda").to(DTYPES[i % 3]) for i in range(200)]
    found, sumsq, norm = (torch.empty(1, device="cuda") for _ in range(3))
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    inv = torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        mpfused.non_finite_check_(tensors, found, inv, sumsq=sumsq, overwrite=True, norm=norm, counter=counter)
        torch.cuda.synchronize()
    gpu = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(gpu) == 1 and "overflow_kernel" in gpu[0], gpu
    assert counter.item() == 0 and found.item() == 0.0 and norm.item() == pytest.approx(sumsq.item() ** 0.5)
