"""mpfused.nn.FusedLinear and convert_linear against torch.nn.Linear + the activation: forward and the three
gradients (float64 references of the same low-precision values), autocast, the FP32 fallback, shapes,
and parameter sharing."""

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mpfused
from mpfused import _ops
from conftest import requires_cuda
from mpfused.nn import FusedLinear, convert_linear
from tolerances import GELU_TOL, LINEAR_REL_TOL, LINEAR_VS_TORCH_FACTOR

LOW = [torch.float16, torch.bfloat16]
ACTIVATIONS = [None, "relu", "gelu", "gelu_erf"]
ROUNDING_UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def activate(y, activation):
    if activation == "relu":
        return F.relu(y)
    if activation == "gelu":
        return F.gelu(y, approximate="tanh")
    if activation == "gelu_erf":
        return F.gelu(y)
    return y


def rel_err(actual, ref):
    return ((actual.double().cpu() - ref.cpu()).abs().max() / ref.abs().max().cpu()).item()


def run(forward, x, params, grad_out):
    """Output and the gradients of (output * grad_out).sum() with respect to x and params."""
    y = forward(x)
    grads = torch.autograd.grad((y.float() * grad_out).sum(), [x] + params)
    return [y.detach()] + list(grads)


def check_against_float64(device, dtype, activation, x_shape, autocast):
    torch.manual_seed(0)
    in_f, out_f = x_shape[-1], 24
    fused = FusedLinear(in_f, out_f, activation=activation, device=device)
    if not autocast:
        fused.to(dtype)
    ref_layer = nn.Linear(in_f, out_f, device=device, dtype=fused.weight.dtype)
    ref_layer.load_state_dict(fused.state_dict())
    x = torch.randn(x_shape, device=device, dtype=fused.weight.dtype, requires_grad=True)
    grad_out = torch.randn(x_shape[:-1] + (out_f,), device=device).to(dtype).float()  # exact in dtype
    params = [fused.weight, fused.bias]
    ctx = (lambda: torch.autocast(device, dtype=dtype)) if autocast else torch.enable_grad
    with ctx():
        ours = run(fused, x, params, grad_out)
        theirs = run(lambda t: activate(ref_layer(t), activation), x, [ref_layer.weight, ref_layer.bias], grad_out)
    # float64 autograd on the same low-precision values
    x64, w64, b64 = (t.detach().to(dtype).double().requires_grad_() for t in (x, fused.weight, fused.bias))
    ref = run(lambda t: activate(F.linear(t, w64, b64), activation), x64, [w64, b64], grad_out.double())
    assert ours[0].dtype == dtype and ours[0].shape == x_shape[:-1] + (out_f,)
    for name, o, t, r in zip(["output", "grad_input", "grad_weight", "grad_bias"], ours, theirs, ref):
        assert o.shape == r.shape and o.dtype == t.dtype, name
        e_ours, e_torch = rel_err(o, r), rel_err(t, r)
        assert e_ours <= LINEAR_REL_TOL[dtype], (name, e_ours)
        assert e_ours <= LINEAR_VS_TORCH_FACTOR * e_torch + ROUNDING_UNIT[dtype], (name, e_ours, e_torch)


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_forward_and_gradients_under_autocast(device, dtype, activation):
    check_against_float64(device, dtype, activation, (3, 5, 40), autocast=True)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_forward_and_gradients_with_low_precision_weights(device, dtype, activation):
    check_against_float64(device, dtype, activation, (17, 33), autocast=False)


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_backward_is_torchs(device, dtype, activation):
    """A 1x1 layer with weight 1 and bias 0 is the activation itself: the input's gradient must be torch's
    activation backward bit for bit (a GELU derivative of the wrong form differs by ~1e-3, below the
    tolerances of the full-layer tests), and the output within one rounding of torch's."""
    layer = FusedLinear(1, 1, activation=activation, device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.fill_(1.0)
        layer.bias.zero_()
    x = torch.linspace(-4, 4, 801, device=device).to(dtype).unsqueeze(1).requires_grad_()
    g = torch.randn(801, 1, device=device).to(dtype)
    y = layer(x)
    (grad,) = torch.autograd.grad(y, x, g)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = activate(x_ref, activation)
    (grad_ref,) = torch.autograd.grad(y_ref, x_ref, g)
    assert torch.equal(grad, grad_ref)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2 * ROUNDING_UNIT[dtype], atol=1e-5)


def test_autocast_grads_reach_fp32_weights(device):
    layer = FusedLinear(16, 8, activation="gelu", device=device)
    x = torch.randn(4, 16, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert layer.weight.dtype == layer.weight.grad.dtype == torch.float32
    assert layer.bias.grad.dtype == torch.float32 and layer.bias.grad.abs().sum() > 0


def test_an_integer_input_under_autocast_is_refused_as_nn_linear_refuses_it(device):
    # autocast casts floating tensors only: an int64 input reaches torch's linear as it is, which refuses it
    # (it was cast to the autocast dtype here, and the layer returned a result).
    fused, ref = FusedLinear(4, 3, device=device), nn.Linear(4, 3, device=device)
    x = torch.arange(8, device=device).reshape(2, 4)
    for layer in (ref, fused):
        with torch.autocast(device, dtype=torch.bfloat16), pytest.raises(RuntimeError, match="same dtype"):
            layer(x)


@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")  # (torch 2.13 deprecates TorchScript)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_torch_jit_script_compiles_torchs_linear_over_the_same_parameters(device, activation):
    # As nn.Linear scripts (the fused path is not TorchScript: the scripted forward is its FP32 fallback's
    # computation); the eager model keeps its FusedLinear modules.
    torch.manual_seed(6)
    model = nn.Sequential(FusedLinear(6, 5, activation=activation, device=device), nn.ReLU(),
                          FusedLinear(5, 3, bias=False, device=device))
    scripted = torch.jit.script(model)
    assert [type(m) for m in model] == [FusedLinear, nn.ReLU, FusedLinear]
    assert scripted[0].weight is model[0].weight
    x = torch.randn(4, 6, device=device)
    assert torch.equal(scripted(x), model(x))
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    assert torch.equal(torch.jit.load(buffer, map_location=device)(x), model(x))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fp32_falls_back_to_torch_exactly(device, activation):
    torch.manual_seed(1)
    fused = FusedLinear(12, 7, activation=activation, device=device)
    ref = nn.Linear(12, 7, device=device)
    ref.load_state_dict(fused.state_dict())
    x = torch.randn(2, 3, 12, device=device, requires_grad=True)
    g = torch.randn(2, 3, 7, device=device)
    ours = run(fused, x, [fused.weight, fused.bias], g)
    theirs = run(lambda t: activate(ref(t), activation), x, [ref.weight, ref.bias], g)
    for o, t in zip(ours, theirs):
        assert torch.equal(o, t)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_unsupported_dtype_falls_back_to_torch_with_one_warning(device, activation, monkeypatch):
    """Where the extension says its GEMM cannot run a dtype (BF16 on sm_75: simulated by its answer),
    FusedLinear computes torch's F.linear + the activation, bit for bit, forward and backward (under
    autocast too), never calls the fused operator, and warns once per device and dtype with the reason."""
    import mpfused.nn as mnn

    reason = "mpfused.gemm: bfloat16 inputs need tensor cores of compute capability 8.0 or newer; this GPU is sm_75"
    asked = []

    def query(dev, dtype):
        asked.append((dev, dtype))
        return reason if dtype == torch.bfloat16 else ""

    def no_gemm(*args, **kwargs):
        raise AssertionError("the fused GEMM ran")

    monkeypatch.setattr(mnn, "_query_gemm", query)
    monkeypatch.setattr(mnn, "_GEMM_UNSUPPORTED", {})
    monkeypatch.setattr(mnn._ops, "gemm", no_gemm)
    torch.manual_seed(2)
    fused = FusedLinear(12, 7, activation=activation, device=device).to(torch.bfloat16)
    ref = nn.Linear(12, 7, device=device, dtype=torch.bfloat16)
    ref.load_state_dict(fused.state_dict())
    x = torch.randn(2, 3, 12, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(2, 3, 7, device=device)
    with pytest.warns(RuntimeWarning, match="torch's matmul.*compute capability 8.0") as record:
        ours = run(fused, x, [fused.weight, fused.bias], g)
        again = run(fused, x, [fused.weight, fused.bias], g)
        with torch.autocast(device, dtype=torch.bfloat16):
            fused.float()(x.float())
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    assert len(asked) == 1  # asked once per device and dtype
    theirs = run(lambda t: activate(ref(t), activation), x, [ref.weight, ref.bias], g)
    for o, a, t in zip(ours, again, theirs):
        assert torch.equal(o, t) and torch.equal(a, t)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", LOW)
def test_gemm_support_answer_follows_the_compute_capability(dtype):
    """The extension's answer on a real GPU: FP16 always runs; BF16 runs from compute capability 8.0 (with
    an sm_80+ image in the build), and below it the reason names the GPU's arch."""
    import mpfused.nn as mnn

    for index in range(torch.cuda.device_count()):
        answer = _ops._C.gemm_unsupported(str(dtype).removeprefix("torch."), index)
        major, minor = torch.cuda.get_device_capability(index)
        if dtype == torch.float16 or major >= 8:
            assert answer == "", (index, answer)
        else:
            assert f"sm_{major}{minor}" in answer
        assert mnn._query_gemm(torch.device("cuda", index), dtype) == answer
    with pytest.raises(ValueError, match="index must name a visible CUDA device"):
        _ops._C.gemm_unsupported("float16", torch.cuda.device_count())
    with pytest.raises(ValueError, match="dtype must be 'float16' or 'bfloat16'"):
        _ops._C.gemm_unsupported("float32", 0)


def test_same_init_and_state_dict_as_nn_linear(device):
    torch.manual_seed(42)
    ref = nn.Linear(20, 9, device=device)
    torch.manual_seed(42)
    fused = FusedLinear(20, 9, activation="relu", device=device)
    assert torch.equal(ref.weight, fused.weight) and torch.equal(ref.bias, fused.bias)
    assert list(ref.state_dict()) == list(fused.state_dict())
    assert fused.weight.abs().max() <= 1 / 20**0.5 and fused.weight.std() > 0.05
    no_bias = FusedLinear(5, 3, bias=False, dtype=torch.bfloat16, device=device)
    assert no_bias.bias is None and no_bias.weight.dtype == torch.bfloat16
    assert repr(fused) == "FusedLinear(in_features=20, out_features=9, bias=True, activation='relu')"
    # nn.Linear's positional order (in, out, bias, device, dtype); activation only by keyword
    positional = FusedLinear(5, 3, False, device, torch.bfloat16)
    assert positional.bias is None and positional.weight.dtype == torch.bfloat16
    assert positional.weight.device.type == torch.device(device).type
    with pytest.raises(RuntimeError, match="relu"):  # the old position of activation is device's now
        FusedLinear(5, 3, True, "relu")


@pytest.mark.parametrize("dtype", LOW)
def test_shapes_views_and_no_bias(device, dtype):
    torch.manual_seed(2)
    layer = FusedLinear(10, 6, bias=False, activation="relu", device=device, dtype=dtype)
    ref = lambda t: F.relu(F.linear(t.double(), layer.weight.double())).to(dtype)  # noqa: E731
    base = torch.randn(4, 10, 3, device=device).to(dtype)
    for x in (base.transpose(1, 2), base[:, :, 0], torch.randn(2, 2, 2, 10, device=device).to(dtype),
              torch.randn(10, device=device).to(dtype)):
        y = layer(x)
        assert y.shape == x.shape[:-1] + (6,)
        assert rel_err(y, ref(x).double()) <= LINEAR_REL_TOL[dtype]
    empty = torch.zeros(0, 10, device=device, dtype=dtype, requires_grad=True)
    y = layer(empty)
    assert y.shape == (0, 6)
    y.sum().backward()
    assert torch.equal(layer.weight.grad, torch.zeros_like(layer.weight)) and empty.grad.shape == (0, 10)


class _GemmCalls(TorchDispatchMode):
    """Records the shapes of the first operand of every mpfused GEMM operator that runs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "mpfused" and func.__name__.startswith("gemm"):
            self.calls.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def test_only_the_needed_gradients_are_computed(device):
    layer = FusedLinear(8, 4, device=device, dtype=torch.bfloat16)
    x = torch.randn(5, 8, device=device, dtype=torch.bfloat16)  # no grad for the input
    with _GemmCalls() as mode:
        layer(x).sum().backward()
    assert mode.calls == [(5, 8), (4, 5)]  # forward + grad_weight (grad^T @ x); no grad_input GEMM
    assert layer.weight.grad is not None and layer.bias.grad is not None
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    x.requires_grad_(True)
    with _GemmCalls() as mode:
        layer(x).sum().backward()
    assert mode.calls == [(5, 8), (5, 4)] and x.grad is not None and x.grad.shape == x.shape  # + grad_input


@pytest.mark.parametrize("activation", ["gelu", "gelu_erf", "relu"])
def test_activation_second_derivative_matches_float64(activation):
    """act''(x), which the activation backward's own derivative holds, against float64 autograd twice
    through torch's activation, on a grid over the range where it is not ~0."""
    from mpfused._ops import _activation_second_derivative
    x = torch.linspace(-8, 8, 4001, dtype=torch.float64)
    x = x[x != 0]  # (ReLU has no second derivative at 0)
    act = {"gelu": lambda t: F.gelu(t, approximate="tanh"), "gelu_erf": F.gelu, "relu": F.relu}[activation]
    xr = x.clone().requires_grad_(True)
    (d1,) = torch.autograd.grad(act(xr).sum(), xr, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), xr)
    ours = _activation_second_derivative(x.float(), activation)
    assert ours.dtype == torch.float32
    rtol, atol = GELU_TOL[torch.float32]
    torch.testing.assert_close(ours.double(), d2, rtol=rtol, atol=atol)


@pytest.mark.parametrize("activation", ["gelu", "gelu_erf", "relu"])
def test_double_backward_matches_float64(device, activation):
    """The backward is made of operators with their own derivatives (the GEMM's, and the activation
    backward's: mpfused::activation_backward, whose formula holds act''), so a second derivative works on
    the fused path too."""
    torch.manual_seed(0)
    layer = FusedLinear(4, 3, activation=activation, device=device, dtype=torch.float16)
    x = torch.randn(2, 4, device=device, dtype=torch.float16, requires_grad=True)
    (g,) = torch.autograd.grad(layer(x).float().sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.float().square().sum(), x)
    xr = x.detach().double().requires_grad_(True)
    w, b = layer.weight.detach().double(), layer.bias.detach().double()
    act = {"gelu": lambda t: F.gelu(t, approximate="tanh"), "gelu_erf": F.gelu, "relu": F.relu}[activation]
    (gr,) = torch.autograd.grad(act(xr @ w.t() + b).sum(), xr, create_graph=True)
    (ggr,) = torch.autograd.grad(gr.square().sum(), xr)
    tol = LINEAR_REL_TOL[torch.float16] * 4  # two more rounded GEMMs and activation derivatives
    assert (gg.double() - ggr).abs().max().item() <= tol * max(ggr.abs().max().item(), 1.0)


@pytest.mark.parametrize("shape", [(3, 0), (0, 3)])
def test_zero_width_layers_have_gradients(device, shape):
    """nn.Linear's behaviour at zero features: empty outputs, zero (or empty) gradients, no error."""
    layer = FusedLinear(*shape, device=device, dtype=torch.float16)
    x = torch.randn(2, 5, shape[0], device=device, dtype=torch.float16, requires_grad=True)
    ref = nn.Linear(*shape).to(device)  # FP32: exact here (empty sums are 0, the bias grad counts rows)
    ref.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    xr = x.detach().float().requires_grad_(True)
    layer(x).float().sum().backward()
    ref(xr).sum().backward()
    for got, want in ((x.grad, xr.grad), (layer.weight.grad, ref.weight.grad), (layer.bias.grad, ref.bias.grad)):
        assert got.shape == want.shape and torch.equal(got.float(), want)


def test_bad_arguments(device):
    with pytest.raises(ValueError, match="activation must be"):
        FusedLinear(4, 3, activation="tanh")
    layer = FusedLinear(4, 3, device=device, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="in_features=4"):
        layer(torch.ones(2, 5, device=device, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError):  # dtype mismatch: torch's own error from the F.linear path
        layer(torch.ones(2, 4, device=device, dtype=torch.float16))
    # the backward operator, which is public too (torch.ops.mpfused.activation_backward)
    g = torch.ones(3, 5, device=device)
    with pytest.raises(ValueError, match="activation must be 'relu', 'gelu' or 'gelu_erf', got 'tanh'"):
        torch.ops.mpfused.activation_backward(g, g, "tanh", None, None)
    with pytest.raises(ValueError, match=r"act_input must have grad's shape \(3, 5\), got \(2, 5\)"):
        torch.ops.mpfused.activation_backward(g, g[:2], "relu", None, None)
    # integer or complex tensors, and an integer bias dtype (the sum was truncated: bias_grad(x, int64) gave 0s)
    with pytest.raises(ValueError, match="grad must be a float16, bfloat16, float32 or float64 tensor, got torch.int64"):
        torch.ops.mpfused.activation_backward(g.long(), g, "relu", None, None)
    with pytest.raises(ValueError, match="act_input must be a float16"):
        torch.ops.mpfused.activation_backward(g, g.to(torch.complex64), "relu", None, None)
    with pytest.raises(ValueError, match="bias_dtype must be torch.float16"):
        torch.ops.mpfused.activation_backward(g, g, "relu", None, torch.int64)
    with pytest.raises(ValueError, match="bias_dtype must be torch.float16"):
        torch.ops.mpfused.bias_grad(g * 0.25, torch.int64)
    with pytest.raises(ValueError, match="grad must be a float16"):
        torch.ops.mpfused.bias_grad(g.int(), torch.float32)
    assert torch.ops.mpfused.bias_grad(g * 0.25, torch.float64).tolist() == [0.75] * 5


# ---- convert_linear ------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, device):
        super().__init__()
        self.proj = nn.Linear(16, 16, device=device)
        self.norm = nn.LayerNorm(16, device=device)

    def forward(self, x):
        return self.norm(x + self.proj(x))


class MyLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def small_mlp(device):
    torch.manual_seed(3)
    shared = nn.Linear(16, 16, device=device)
    return nn.Sequential(nn.Linear(12, 16, device=device), nn.ReLU(), Block(device), shared, nn.GELU(), shared,
                         MyLinear(16, 8, device=device), nn.Linear(8, 4, bias=False, device=device))


def test_convert_linear_same_outputs_and_shared_parameters(device):
    model = small_mlp(device)
    reference = copy.deepcopy(model)
    params_before = {name: p for name, p in model.named_parameters()}
    model[0].weight.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert convert_linear(model) is model
    assert type(model[0]) is FusedLinear and type(model[2].proj) is FusedLinear and type(model[7]) is FusedLinear
    assert type(model[3]) is FusedLinear and model[3] is model[5]  # one module used twice: one replacement
    assert type(model[6]) is MyLinear  # subclasses are left alone
    assert model[7].bias is None
    for name, p in model.named_parameters():
        assert p is params_before[name], name  # the very same Parameter objects
    assert model[0].weight.requires_grad is False and model[0].bias.requires_grad is True

    x = torch.randn(5, 12, device=device)
    assert torch.equal(model(x), reference(x))  # FP32: torch's path, bit for bit
    with torch.autocast(device, dtype=torch.bfloat16):
        ours, theirs = model(x), reference(x)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=0.05, atol=0.02)

    # the optimizer made before the conversion still updates the converted model
    with torch.autocast(device, dtype=torch.bfloat16):
        model(x).float().square().mean().backward()
    before = model[2].proj.weight.detach().clone()
    opt.step()
    assert not torch.equal(model[2].proj.weight, before)
    assert model[0].weight.grad is None


@pytest.mark.parametrize("dtype", LOW)
def test_convert_linear_is_exact_on_small_integers(device, dtype):
    """With small-integer weights and inputs every product and sum is exact: the converted model under
    autocast gives the same bits as the original one."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(24, 32, device=device), nn.ReLU(), nn.Linear(32, 8, device=device))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-2, 3, p.shape))
    reference = copy.deepcopy(model)
    convert_linear(model)
    x = torch.randint(-2, 3, (6, 24), device=device).float()
    with torch.autocast(device, dtype=dtype):
        ours, theirs = model(x), reference(x)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs) and ours.abs().max() > 0


def test_convert_linear_leaves_hooked_and_reparametrized_linears_alone(device):
    """weight_norm / spectral_norm keep an nn.Linear's weight as a plain tensor that a forward pre-hook
    recomputes (replacing the module raised midway, the layers before it already replaced); a hook of the
    user's is part of what the module does. Such linears stay as they are; the others are replaced."""
    torch.manual_seed(5)
    seen = []
    hooked = nn.Linear(8, 8, device=device)
    hooked.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (torch deprecates weight_norm for parametrizations)
        normed = nn.utils.weight_norm(nn.Linear(8, 8, device=device))
    spectral = nn.utils.spectral_norm(nn.Linear(8, 8, device=device))
    wrapped = nn.Linear(8, 8, device=device)  # a forward replaced on the instance (as accelerate's hooks do)
    plain_forward = wrapped.forward
    wrapped.forward = lambda x: plain_forward(x) * 0.5
    model = nn.Sequential(nn.Linear(8, 8, device=device), normed, spectral, hooked, wrapped,
                          nn.Linear(8, 2, device=device))
    model.eval()  # (spectral_norm's power iteration then stays put: the same weight in both calls)
    x = torch.randn(3, 8, device=device)
    expected = model(x)  # (deepcopy refuses a weight_norm module)
    assert convert_linear(model) is model
    assert [type(m) for m in model] == [FusedLinear, nn.Linear, nn.Linear, nn.Linear, nn.Linear, FusedLinear]
    assert model[1] is normed and model[2] is spectral and model[3] is hooked and model[4] is wrapped
    assert torch.equal(model(x), expected) and seen == [(3, 8), (3, 8)]
    assert convert_linear(hooked) is hooked and convert_linear(normed) is normed


def test_convert_linear_on_a_bare_linear_and_bad_input(device):
    lin = nn.Linear(3, 2, device=device)
    fused = convert_linear(lin)
    assert type(fused) is FusedLinear and fused.weight is lin.weight and fused.bias is lin.bias
    lin.eval()
    assert convert_linear(lin).training is False
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        convert_linear("not a model")


def test_exports():
    assert mpfused.nn.FusedLinear is FusedLinear
    assert mpfused.gemm is mpfused.functional.gemm
    for name in ("gemm", "functional", "nn"):
        assert name in mpfused.__all__


def test_fx_symbolic_trace_takes_a_converted_model():
    """FusedLinear's forward branched on the input's device and dtype, which a torch.fx proxy cannot answer: a
    model through convert_linear no longer traced (FX quantization, feature extractors). The forward is now one
    wrapped call in the graph, and the traced module computes what the module does."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).half()
    mpfused.nn.convert_linear(m)
    gm = torch.fx.symbolic_trace(m)
    assert sum(n.op == "call_function" and n.target.__name__ == "_linear_forward" for n in gm.graph.nodes) == 2
    x = torch.randn(3, 4).half()
    assert torch.equal(gm(x), m(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_replaced_weight_or_bias_and_a_sparse_input_work_as_in_nn_linear(device, dtype):
    """nn.Linear computes with its weight's shapes, not in_features/out_features (code replaces a weight when
    it prunes or grows a layer), broadcasts any bias F.linear takes, and takes a sparse input; the fused path
    refused all three (one with the GEMM's operand name). Small integers: every product and sum is exact, so
    both layers give the same bits."""
    def ints(*shape):
        return torch.randint(-3, 4, shape, device=device).to(dtype)

    ref = nn.Linear(4, 3, device=device, dtype=dtype)
    fused = FusedLinear(4, 3, device=device, dtype=dtype)
    for w, b in [((3, 6), None), ((5, 6), (5,)), ((3, 4), (1,))]:
        weight, bias = ints(*w), None if b is None else ints(*b)
        for layer in (ref, fused):
            layer.weight = nn.Parameter(weight.clone())
            layer.bias = None if bias is None else nn.Parameter(bias.clone())
        x = ints(2, 7, w[1]).requires_grad_()
        outs = [layer(x) for layer in (ref, fused)]
        assert torch.equal(outs[0], outs[1]), (w, b)
        grads = [torch.autograd.grad(y.sum(), [x] + list(layer.parameters())) for y, layer in zip(outs, (ref, fused))]
        assert all(torch.equal(g, h) for g, h in zip(*grads)), (w, b)
    bias = ints(3)  # (the fused path's own shapes again)
    ref.bias, fused.bias = nn.Parameter(bias.clone()), nn.Parameter(bias.clone())
    with pytest.raises(RuntimeError, match=r"the weight's in_features=4 \(a weight of shape \(3, 4\)\), got an input of "
                                           r"shape \(2, 6\)"):
        fused(ints(2, 6))
    if device == "cpu":  # (sparse FP16/BF16 matmuls are CPU-only in torch)
        x = ints(2, 4).to_sparse()
        assert torch.equal(fused(x), ref(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_nested_input_takes_torchs_linear(dtype):
    """A strided nested tensor has no single shape: the fused path raised torch's internal error; it takes
    torch's linear, as nn.Linear does."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 4, dtype=dtype)
    fused = mpfused.nn.FusedLinear(8, 4, dtype=dtype)
    fused.load_state_dict(ref.state_dict())
    x = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], dtype=dtype)
    for a, b in zip(fused(x).unbind(), ref(x).unbind()):
        assert torch.equal(a, b)
