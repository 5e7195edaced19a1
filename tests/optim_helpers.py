"""Helpers shared by the optimizer tests (test_lamb.py, test_lion.py): the FP32 weight a step updates,
rounded inputs, and bit-for-bit snapshots of params and optimizer state."""

import torch


def rounded(tensors, dtype):
    """What a run in ``dtype`` starts from or is fed: the values rounded to dtype."""
    return [t.to(dtype) for t in tensors]


def fp32_weight(opt, p):
    """The FP32 weight the step updates: the master copy when there is one, else the param."""
    return opt.state[p].get("master_param", p.detach())


def bits(t):
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def snapshot(opt, params):
    return [bits(p) for p in params], [{k: bits(v) for k, v in opt.state[p].items()} for p in params]


def assert_same(a, b):
    """Two snapshots are equal bit for bit: params, state keys and state values."""
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    for sa, sb in zip(a[1], b[1], strict=True):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
