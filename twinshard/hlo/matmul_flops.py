"""The FLOPs of one matmul instruction as XLA writes it: a dot, or on a TPU a convolution (some with padded
windows that compute a batch of matmuls). The step-time model (twinshard/hlo/timing.py) prices with them."""

import math
import re

from twinshard.hlo.parse import Instr, Shape


def dot_flops(instr: Instr, lhs: Shape, res: Shape) -> float:
    """2 x result elements x the contracted size."""
    dims = [int(d) for d in re.findall(r"\d+", instr.attrs.get("lhs_contracting_dims", "{}"))]
    return 2.0 * math.prod(res.dims) * math.prod(lhs.dims[d] for d in dims)


def _window(text: str) -> dict[str, list[str]]:
    """`{size=1x4 pad=0_0x3_3 stride=1x3}` -> {'size': ['1', '4'], 'pad': ['0_0', '3_3'], ...}."""
    return {k: v.split("x") for k, v in re.findall(r"(\w+)=([\w\-]+)", text)}


def conv_flops(instr: Instr, lhs: Shape, rhs: Shape, res: Shape) -> float:
    """2 x output batch x output features x input features per group x the (output, kernel) position
    pairs that land on real input (not padding nor lhs-dilation holes), per spatial dimension.
    TPU writes every matmul as a convolution, some with padded windows that compute a batch of them."""
    labels = instr.attrs.get("dim_labels", "")
    m = re.fullmatch(r"(\w+)_(\w+)->(\w+)", labels)
    if not m:
        raise ValueError(f"convolution %{instr.name} without dim_labels")
    ll, rl, ol = m.groups()
    win = _window(instr.attrs.get("window", "{}"))
    n_spatial = sum(c.isdigit() for c in ll)
    pairs = 1
    for d in range(n_spatial):
        n, k, o = lhs.dims[ll.index(str(d))], rhs.dims[rl.index(str(d))], res.dims[ol.index(str(d))]
        lo = int(win["pad"][d].split("_")[0]) if "pad" in win else 0
        stride = int(win["stride"][d]) if "stride" in win else 1
        ld = int(win["lhs_dilate"][d]) if "lhs_dilate" in win else 1
        rd = int(win["rhs_dilate"][d]) if "rhs_dilate" in win else 1
        span = (n - 1) * ld  # last real input position after dilation
        pairs *= sum(_landing(o, stride, ki * rd - lo, span, ld) for ki in range(k))
    groups = int(instr.attrs.get("batch_group_count", "1"))
    return 2.0 * (lhs.dims[ll.index("b")] // groups) * rhs.dims[rl.index("o")] * rhs.dims[rl.index("i")] * pairs


def _landing(o: int, stride: int, shift: int, span: int, ld: int) -> int:
    """How many output positions oi in [0, o) read a real input at oi * stride + shift in [0, span],
    on a multiple of the lhs dilation ld."""
    if ld > 1:
        return sum(1 for oi in range(o) if 0 <= (p := oi * stride + shift) <= span and p % ld == 0)
    first = max(0, -(shift // stride) if shift < 0 else 0)  # smallest oi with oi * stride + shift >= 0
    while first * stride + shift < 0:
        first += 1
    last = min(o - 1, (span - shift) // stride) if span >= shift else -1
    return max(last - first + 1, 0)
