"""The overflow demo (`python -m mpfused.demo --quick`): the properties its table claims really hold on the
trained model's gradients, and the JSON holds the same numbers."""

import json
import math

import pytest
import torch

from tolerances import SUMSQ_RTOL

demo = pytest.importorskip("mpfused.demo")

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_out")
    res = demo.main(["--quick", "--out", str(out)])
    return res, out


def rows(res, dtype):
    rs = [r for r in res["sweep"] if r["dtype"] == dtype]
    assert [r["log2_scale"] for r in rs] == sorted(demo.LOG2_SCALES)
    return rs


def norm_rtol(dtype, n_elements, scale, ref):
    """Bound on |norm - ref| / ref for gradients that did not overflow.

    Casting the FP32 gradient x = S*g to FP16/BF16 with round-to-nearest gives, per element, an error of
    at most u*|x| in the normal range (unit roundoff u = 2^-11 for FP16, 2^-8 for BF16) and at most half
    the smallest subnormal (2^-25 for FP16) below it, flushes to zero included. By the triangle
    inequality on the vector of errors, after unscaling by 1/S:
        | ||x_low||/S - ||g|| | <= u*||g|| + sqrt(n) * half_min_subnormal / S.
    The kernel then accumulates the sum of squares in FP32: relative error <= SUMSQ_RTOL on the sum
    (see tolerances.py), i.e. <= SUMSQ_RTOL/2 on its square root. The reference is FP64 over the FP32
    gradients (exact by comparison).
    """
    fi = torch.finfo(DTYPES[dtype])
    u = fi.eps / 2
    half_min_subnormal = fi.tiny * fi.eps / 2
    return u + math.sqrt(n_elements) * half_min_subnormal / scale / ref + SUMSQ_RTOL[DTYPES[dtype]] / 2


def test_json_is_written_and_holds_the_returned_numbers(run):
    res, out = run
    path = out / "overflow_demo.json"
    assert path.is_file()
    on_disk = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert on_disk["sweep"] == res["sweep"]
    assert on_disk["timing"] == res["timing"]
    assert len(res["sweep"]) == 2 * len(demo.LOG2_SCALES)
    assert res["device"] in ("cpu", "cuda")


def test_training_made_the_gradients_realistic(run):
    res, _ = run
    tr = res["training"]
    assert tr["steps"] > 0 and tr["loss_last"] < tr["loss_first"] < math.log(256) + 0.1


def test_fp16_overflows_at_the_largest_scale_and_not_at_scale_one(run):
    res, _ = run
    f16 = rows(res, "float16")
    assert f16[0]["log2_scale"] == 0 and f16[0]["found_inf"] == 0.0
    assert f16[-1]["found_inf"] == 1.0
    assert f16[-1]["norm"] is None  # the unscaled sum of squares is inf, reported as null
    # Once a scale overflows, every larger one does too.
    flags = [r["found_inf"] for r in f16]
    assert flags == sorted(flags)
    # found_inf agrees with the data: FP16 overflows exactly when max |S*g| rounds past 65504.
    for r in f16:
        assert (r["found_inf"] == 1.0) == (r["max_abs_scaled_fp32"] >= 65520.0), r


def test_bf16_never_overflows(run):
    res, _ = run
    assert all(r["found_inf"] == 0.0 for r in rows(res, "bfloat16"))


def test_loss_scaling_reduces_fp16_underflow(run):
    res, _ = run
    f16 = rows(res, "float16")
    mid = [r for r in f16 if r["log2_scale"] > 0 and r["found_inf"] == 0]
    assert mid, "no scale between 1 and overflow"
    assert f16[0]["flushed"] > 0
    assert f16[0]["flushed_frac"] > mid[-1]["flushed_frac"]
    # Scaling by 2^k is exact in FP32, so an element that flushes at a larger S flushes at every smaller
    # one: the flushed count can only fall as S grows.
    counts = [r["flushed"] for r in f16]
    assert counts == sorted(counts, reverse=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_unscaled_norm_matches_fp32_reference(run, dtype):
    res, _ = run
    n = res["model"]["parameters"]
    checked = 0
    for r in rows(res, dtype):
        if r["found_inf"]:
            continue
        # The reference for exactly the gradients that were cast: FP64 norm of the FP32 grads of S*loss / S.
        ref = r["ref_norm_scaled_grads"]
        # Scaling the loss by 2^k scales every FP32 gradient exactly (1e-5: room for a nondeterministic
        # FP32 backward on CUDA), so this is also the norm of the gradients of the unscaled loss.
        assert ref == pytest.approx(r["ref_norm"], rel=1e-5)
        rtol = norm_rtol(dtype, n, r["scale"], ref)
        assert rtol < 5e-3
        assert abs(r["norm"] - ref) <= rtol * ref, (r, rtol)
        checked += 1
    assert checked >= 2


def test_timing_is_measured(run):
    res, _ = run
    t = res["timing"]
    n, ref = t["elements"], res["sweep"][0]["ref_norm"]
    # Both pairs unscaled the same FP16 list. Ours: the bound above at the timed scale. torch's norm is
    # taken after the unscaled values were rounded back to FP16 (a second rounding, u = 2^-11, with
    # flushes at the unscaled magnitude, S = 1).
    bounds = {"mpfused": norm_rtol("float16", n, 2.0 ** t["log2_scale"], ref),
              "torch": norm_rtol("float16", n, 1.0, ref) + 2 ** -11}
    for name, bound in bounds.items():
        assert t[name]["median_us"] > 0 and t[name]["repeats"] >= 3
        assert t[name]["found_inf"] == 0.0  # timed at a scale that does not overflow
        assert t[name]["rel_err"] <= bound, (name, t[name], bound)
