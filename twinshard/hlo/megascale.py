"""Collectives across TPU slices, as a program compiled for several slices sends them over DCN.

libtpu compiles a program for `num_slices` slices as ONE slice's program (`num_partitions` = the
slice's chips) and sends each collective across slices as a host-transfer send/recv pair that the
megascale runtime carries over the data-center network (measured, libtpu 0.0.50.1, hsdp on
v5e:2x2 x 2 slices):

    %send.3 = (f32[1,1,128], u32[], token[]) send(%all-reduce.10, %after-all.3), is_host_transfer=true,
        frontend_attributes={_xla_host_transfer_rendezvous="psum_invariant.135_0",
                             _xla_megascale_reduce_operation="SUM", _xla_megascale_transfer_type="ALL_REDUCE", ...}
    %recv.3 = (f32[1,1,128], u32[], token[]) recv(%after-all.3), ...same attributes...
    %send-done.3 = token[] send-done(%send.3)          # the buffer handed over
    %recv-done.3 = (f32[1,1,128], token[]) recv-done(%recv.3)   # the result, reduced across slices

The send and the recv of one collective share the rendezvous name. `transfers` pairs them; `dcn_records`
makes each pair one ledger record over the DCN axes, in flight from the send to the recv-done (the
schedule reader's window). Its bytes are the data it carries: libtpu packs a collective's operands into
one buffer padded to its tiles (f32[27,8,128] for 26944 floats of gradient shards; a scalar loss as
f32[1,1,128]), so the payload is the smallest array along the chain of views that feeds the send.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from twinshard.hlo.groups import MeshSpec
from twinshard.hlo.parse import Instr, Module, Shape, parse_shape, split_top

TRANSFER_TYPE = "_xla_megascale_transfer_type"
_RENDEZVOUS = "_xla_host_transfer_rendezvous"
_REDUCE = "_xla_megascale_reduce_operation"
# _xla_megascale_transfer_type -> the collective (the ledger's op names)
TRANSFER_OPS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
                "ALL_TO_ALL": "all-to-all"}
_REDUCTIONS = {"SUM": "sum", "MAX": "max", "MIN": "min", "PRODUCT": "product", "AND": "and", "OR": "or"}
# Instructions between a payload and the send that move no data of their own: layout views, the
# ZeroCrop custom call that zero-pads it into the transfer buffer, and the all-reduce inside the slice
# that XLA runs first when a collective spans both the slice and the slices (the loss's psum over data,fsdp).
_VIEWS = ("bitcast", "copy", "reshape", "all-reduce")


@dataclass(frozen=True)
class Transfer:
    """One collective across slices: its op and reduction, the send/recv pair, and the data it carries."""

    op: str
    reduction: str
    computation: str
    send: str
    recv_done: str
    payload: Shape  # the data (what the model counts)
    buffer: Shape  # the padded buffer sent over DCN


def frontend_attributes(instr: Instr) -> dict[str, str]:
    """`frontend_attributes={a="x",b="y"}` -> {'a': 'x', 'b': 'y'}."""
    text = instr.attrs.get("frontend_attributes", "").strip()
    if not text.startswith("{"):
        return {}
    pairs = (p.partition("=") for p in split_top(text[1:-1]))
    return {k.strip(): v.strip().strip('"') for k, eq, v in pairs if eq}


def is_megascale(instr: Instr) -> bool:
    """A send or recv the megascale runtime carries across slices."""
    return instr.opcode in ("send", "recv") and TRANSFER_TYPE in instr.attr_text


def transfers(mod: Module) -> list[Transfer]:
    """Every megascale send/recv pair of the module; a pair that cannot be read raises one line."""
    out = []
    for comp, instrs in mod.computations.items():
        named = {i.name: i for i in instrs}
        ends = {i.operands[0]: i.name for i in instrs if i.opcode == "recv-done" and i.operands}
        recvs = {frontend_attributes(i).get(_RENDEZVOUS): i for i in instrs if i.opcode == "recv" and is_megascale(i)}
        for send in (i for i in instrs if i.opcode == "send" and is_megascale(i)):
            out.append(_transfer(send, recvs, ends, named, comp))
    return out


def _transfer(send: Instr, recvs: dict, ends: dict[str, str], named: dict[str, Instr], comp: str) -> Transfer:
    attrs = frontend_attributes(send)
    kind, key = attrs.get(TRANSFER_TYPE, ""), attrs.get(_RENDEZVOUS)
    where = f"megascale send %{send.name} in %{comp}"
    if kind not in TRANSFER_OPS:
        raise ValueError(f"{where}: {TRANSFER_TYPE}={kind!r} is not one of {sorted(TRANSFER_OPS)}; pass the "
                         "HLO text as XLA printed it (compiled.as_text()).")
    recv = recvs.get(key)
    if recv is None or recv.name not in ends:
        raise ValueError(f"{where}: no recv and recv-done share its {_RENDEZVOUS}={key!r}, so the transfer has no "
                         "end; pass the whole module as XLA printed it (compiled.as_text()).")
    reduction = attrs.get(_REDUCE, "")
    if kind in ("ALL_REDUCE", "REDUCE_SCATTER") and reduction not in _REDUCTIONS:
        raise ValueError(f"{where}: {_REDUCE}={reduction!r} is not one of {sorted(_REDUCTIONS)}; pass the HLO "
                         "text as XLA printed it (compiled.as_text()).")
    buffer = parse_shape(send.shape_text)[0]
    return Transfer(TRANSFER_OPS[kind], _REDUCTIONS.get(reduction, ""), comp, send.name, ends[recv.name],
                    _payload(send, named), buffer)


def _payload(send: Instr, named: dict[str, Instr]) -> Shape:
    """The smallest array along the views from the send's data operand back to the op that computed it."""
    seen: list[Shape] = []
    node = named.get(send.operands[0])
    while node is not None:
        shape = parse_shape(node.shape_text)
        if isinstance(shape, Shape):
            seen.append(shape)
        zero_crop = node.opcode == "custom-call" and "ZeroCrop" in node.attr_text
        if not (node.opcode in _VIEWS or zero_crop) or not node.operands:
            break
        node = named.get(node.operands[0])
    if not seen:
        raise ValueError(f"megascale send %{send.name}: its data operand %{send.operands[0]} is not an array of "
                         "its computation; pass the whole module as XLA printed it (compiled.as_text()).")
    return min(reversed(seen), key=lambda s: s.bytes)  # of equal sizes, the one nearest the data's producer


def dcn_axes(mod: Module, spec: MeshSpec) -> tuple[str, ...]:
    """The mesh axes across slices of a one-slice program with megascale transfers ((): none): the
    leading axes whose product is the slice count (the hybrid mesh puts the DCN axes outermost)."""
    if not any(is_megascale(i) for instrs in mod.computations.values() for i in instrs):
        return ()
    mesh = dict(zip(spec.names, spec.shape))
    chips = mod.num_partitions or 0
    if chips < 1 or spec.size % chips:
        raise ValueError(f"the program sends collectives across slices but has num_partitions={mod.num_partitions}, "
                         f"which does not divide the mesh {mesh}: pass the mesh across slices it was compiled for.")
    slices, product = spec.size // chips, 1
    if slices == 1:
        raise ValueError(f"the program sends collectives across slices but the mesh {mesh} is one slice's "
                         f"({chips} chips): pass the mesh across slices it was compiled for, DCN axes first.")
    for k, n in enumerate(spec.shape):
        if product == slices:
            return spec.names[:k]
        product *= n
    raise ValueError(f"the program is one slice of {chips} chips, {slices} slices in all, but no leading axes of the "
                     f"mesh {mesh} make {slices}: pass the mesh with its DCN axes first (mesh.hybrid_mesh's order).")


def slices_of(spec: MeshSpec, axes: tuple[str, ...]) -> int:
    return math.prod(n for a, n in zip(spec.names, spec.shape) if a in axes)
