"""The CPU instruction-set paths (MPFUSED_CPU_ISA): forcing a path, the errors for bad or unsupported
values, and bit-identical kernel results under every path this CPU supports. Each case runs in a
subprocess because the path is chosen once per process."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import mpfused

ROOT = Path(__file__).resolve().parents[1]
# Where the mpfused under test comes from (the source tree, or site-packages when the tests run against
# an installed build): the subprocesses must import that one, not an unbuilt source tree.
PKG_ROOT = Path(mpfused.__file__).resolve().parents[1]
PATHS = ["scalar", "avx2", "avx512"]
SUPPORTED = mpfused.build_info()["cpu_isa_supported"].split(", ")


def path_param(name):
    """A path as a parameter, skipped only where this CPU lacks the instructions."""
    reason = "this CPU has no AVX-512" if name == "avx512" else "this CPU has no AVX2+FMA+F16C"
    return pytest.param(name, marks=pytest.mark.skipif(name not in SUPPORTED, reason=reason))


def run_python(code, isa, check=True):
    env = dict(os.environ)
    if isa is None:
        env.pop("MPFUSED_CPU_ISA", None)
    else:
        env["MPFUSED_CPU_ISA"] = isa
    env["PYTHONPATH"] = str(PKG_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=PKG_ROOT, capture_output=True,
                       text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


REPORT = "import mpfused; print(mpfused.build_info()['cpu_isa'])"


@pytest.mark.parametrize("isa", [path_param(p) for p in PATHS])
def test_forced_path_is_reported(isa):
    # build_info(), then `python -m mpfused`, in one process (each import of torch costs seconds)
    lines = run_python(REPORT + "; import runpy; runpy.run_module('mpfused', run_name='__main__')", isa).stdout.splitlines()
    assert lines[0].strip() == isa
    assert any(line.split() == ["cpu_isa", isa] for line in lines[1:]), lines


@pytest.mark.parametrize("value", [None, "auto", ""])
def test_auto_picks_the_best_supported(value):
    assert run_python(REPORT, value).stdout.strip() == SUPPORTED[-1]


@pytest.mark.parametrize("value", ["avx3", "AVX2", "sse"])
def test_unknown_value_raises_at_import(value):
    r = run_python(REPORT, value, check=False)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: MPFUSED_CPU_ISA="), r.stderr
    assert f"'{value}'" in last and "scalar" in last and "avx512" in last
    assert "Segmentation" not in r.stderr


def test_unsupported_path_raises_naming_the_supported_ones():
    missing = [p for p in PATHS if p not in SUPPORTED]
    if not missing:
        pytest.skip("this CPU supports every path: none to refuse")
    r = run_python(REPORT, missing[-1], check=False)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: MPFUSED_CPU_ISA='{missing[-1]}'"), r.stderr
    assert "supported here: " + ", ".join(SUPPORTED) in last


# Every CPU kernel on inputs that reach every code branch (block and tail, non-finite values,
# subnormal and overflowing FP16 results), results saved bit for bit.
KERNELS = """
import sys, torch, mpfused
from mpfused.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedLion, FusedSGD
g = torch.Generator().manual_seed(7)
out = {}
for dt in (torch.float32, torch.float16, torch.bfloat16):
    sizes = [1, 31, 33, 515, 4096 + 17, 70001]
    ts = [(torch.randn(n, generator=g) * 3000).to(dt) for n in sizes]
    ts[2][5] = 1e-7  # subnormal after unscaling in FP16
    clean = [t.clone() for t in ts]
    for name, kw in [("sumsq", dict(sumsq=True)), ("unscale", dict(unscale=True)),
                     ("both", dict(unscale=True, sumsq=True))]:
        xs = [t.clone() for t in clean]
        found = torch.zeros(()); inv = torch.tensor(1 / 1024.)
        s = torch.zeros(()) if kw.get("sumsq") else None
        mpfused.non_finite_check_(xs, found, inv, unscale=kw.get("unscale", False), sumsq=s)
        out[f"{dt}-{name}"] = [found, s] + xs
    bad = [t.clone() for t in clean]; bad[4][4000] = float("nan")
    found = torch.zeros(()); mpfused.non_finite_check_(bad, found)
    out[f"{dt}-nan"] = found
    for inv in (1 / 1024., 2.0**60):  # a NaN found through the sums; finite squares that overflow the sum
        found, s = torch.zeros(()), torch.zeros(())
        mpfused.non_finite_check_(bad, found, torch.tensor(inv), sumsq=s)
        out[f"{dt}-sumsq-nan-{inv}"] = [found, s]
        found, s = torch.zeros(()), torch.zeros(())
        mpfused.non_finite_check_(clean, found, torch.tensor(inv), sumsq=s)
        out[f"{dt}-sumsq-{inv}"] = [found, s]
# FP16 sums of squares at the edges of folding a power-of-two inv_scale out of the loop: subnormal
# inputs, 2^-39 (folded) and 2^-40 (not), squares that overflow, scales that are not powers of two.
edge = torch.cat([torch.randn(5000, generator=g) * 2.0**-14, torch.randn(5000, generator=g) * 60000]).half()
edge[::97] = 2.0**-24
for inv in (2.0**-39, 2.0**-40, 2.0**-60, 2.0**63, 2.0**64, 3.0, 0.75):
    for part in (edge[:5000], edge[5000:], edge):  # each alone: the small values' sum must not drown
        found, s = torch.zeros(()), torch.zeros(())
        mpfused.non_finite_check_([part], found, torch.tensor(inv), sumsq=s)
        out[f"f16-edge-sumsq-{inv}-{part.numel()}-{float(part[0])}"] = [found, s]
for dt in (torch.float16, torch.bfloat16):
    ps = [torch.nn.Parameter((torch.randn(n, generator=g)).to(dt)) for n in (5, 1000, 4099, 40000)]
    for opt in (FusedAdamW(ps, lr=1e-2, master_weights=True), FusedSGD(ps, lr=1e-2, momentum=0.9),
                FusedAdam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, master_weights=False),
                FusedLAMB(ps, lr=1e-2), FusedLion(ps, lr=1e-3, weight_decay=0.1)):
        for i in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(dt)
            if i == 2:  # a scaled step: the kernel writes the unscaled gradient back into p.grad
                opt.grad_scale, opt.found_inf = torch.tensor([8.0]), torch.zeros(1)
            opt.step()
        del opt.grad_scale, opt.found_inf
        out[f"{dt}-{type(opt).__name__}"] = [p.detach().clone() for p in ps] + [p.grad.clone() for p in ps]
    # the precision modes: stochastic write-back (no masters, and the model copy of masters), remainders
    modes = [(FusedAdamW, dict(master_weights=False, rounding="stochastic", seed=2**50 + 3)),
             (FusedSGD, dict(master_weights=True, rounding="stochastic", seed=17)),
             (FusedLion, dict(master_weights=False, rounding="stochastic", seed=5))]
    if dt == torch.bfloat16:
        modes += [(FusedAdam, dict(master_weights="remainder", amsgrad=True)), (FusedLAMB, dict(master_weights="remainder"))]
    for cls, kw in modes:
        ps = [torch.nn.Parameter((torch.randn(n, generator=g)).to(dt)) for n in (5, 1000, 4099, 40000)]
        opt = cls(ps, lr=1e-3, **kw)
        for i in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(dt)
            if i == 2:  # a scaled step: the unscaled gradient written back beside the (rounded) param
                opt.grad_scale, opt.found_inf = torch.tensor([4.0]), torch.zeros(1)
            opt.step()
        del opt.grad_scale, opt.found_inf
        out[f"{dt}-{cls.__name__}-{kw}"] = [p.detach().clone() for p in ps] + [p.grad.clone() for p in ps] + [
            v.clone() for p in ps for v in opt.state[p].values()]
    # non-finite and tied values inside full tiles (16 values) and a tile's tail, in every rounding and
    # weight source: the NaN lanes of the joined and split remainders, infs, masters on a BF16 tie
    specials = [float("nan"), float("inf"), -float("inf"), 1 + 2.0**-8, -(1 + 3 * 2.0**-8), 2.0**-130]
    modes = [(FusedAdam, dict(master_weights=False)), (FusedAdam, dict(master_weights=True)),
             (FusedAdam, dict(master_weights=False, rounding="stochastic", seed=9))]
    if dt == torch.bfloat16:
        modes.append((FusedAdam, dict(master_weights="remainder")))
    for cls, kw in modes:
        ps = [torch.nn.Parameter((torch.randn(n, generator=g)).to(dt)) for n in (21, 1000)]
        for p in ps:
            p.data[3:3 + len(specials)] = torch.tensor(specials).to(dt)
            p.data[-4:] = torch.tensor(specials[:4]).to(dt)
        opt = cls(ps, lr=1e-3, **kw)
        for i in range(2):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(dt)
                p.grad[11] = float("nan") if i == 0 else float("inf")
            opt.step()
        out[f"{dt}-specials-{kw}"] = [p.detach().clone() for p in ps] + [
            v.clone() for p in ps for v in opt.state[p].values()]
    a = torch.randn(37, 70, generator=g).to(dt); b = torch.randn(70, 45, generator=g).to(dt)
    bias = torch.randn(45, generator=g).to(dt); c = torch.randn(37, 45, generator=g).to(dt)
    for act in (None, "relu", "gelu"):
        out[f"{dt}-gemm-{act}"] = mpfused.gemm(a, b, bias=bias, activation=act, alpha=0.5, beta=0.25, c=c)
torch.save(out, sys.argv[1] if len(sys.argv) > 1 else OUT)
"""


def kernel_results(isa, path):
    run_python(KERNELS.replace("OUT", repr(str(path))), isa)
    return torch.load(path)


def assert_bitwise_equal(x, y, key):
    if isinstance(x, list):
        assert len(x) == len(y)
        for a, b in zip(x, y):
            assert_bitwise_equal(a, b, key)
    elif x is None:
        assert y is None, key
    else:
        assert x.dtype == y.dtype and x.shape == y.shape, key
        bits = {4: torch.int32, 2: torch.int16}[x.element_size()]
        xb, yb = x.contiguous().view(bits), y.contiguous().view(bits)
        nan = torch.isnan(x)
        assert torch.equal(nan, torch.isnan(y)), key  # a NaN stays a NaN; payloads may differ
        assert torch.equal(xb[~nan], yb[~nan]), f"{key}: results differ between CPU paths"


@pytest.fixture(scope="module")
def scalar_results(tmp_path_factory):
    """The scalar path's results, computed once for every path compared with them."""
    return kernel_results("scalar", tmp_path_factory.mktemp("isa") / "scalar.pt")


@pytest.mark.parametrize("isa", [path_param(p) for p in PATHS[1:]])
def test_kernels_bit_identical_to_scalar_path(isa, scalar_results, tmp_path):
    ref = scalar_results
    got = kernel_results(isa, tmp_path / f"{isa}.pt")
    assert ref.keys() == got.keys()
    for key in ref:
        assert_bitwise_equal(ref[key], got[key], key)
    assert ref["torch.float16-nan"].item() == 1.0


def test_avx512_clone_uses_512_bit_vectors():
    """Holds on any x86-64: reads the machine code of the built extension (objdump), no AVX-512 needed."""
    sys.path.insert(0, str(ROOT / ".ci"))
    try:
        import check_isa_clones
    finally:
        sys.path.pop(0)
    so = Path(mpfused._ops._C.__file__)
    assert check_isa_clones.check(str(so)) == []
