"""Collectives across TPU slices: what a multi-slice program sends over the data-center network (DCN).

A program compiled for several TPU slices (`jax.experimental.topologies.get_topology_desc(...,
num_slices=N)`) is one slice's program: `num_partitions` counts one slice's chips, its replica groups
stay inside the slice, and each collective over the slices is a `send` / `recv` pair to the host
(`is_host_transfer=true`) that the megascale runtime carries, e.g. a gradient shard's all-reduce:

    %send = (f32[8,4,128]{...}, u32[], token[]) send(%grad_shard, %after-all), is_host_transfer=true,
        frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",
        _xla_host_transfer_rendezvous="all-reduce.1_0", _xla_megascale_reduce_operation="SUM",
        _xla_megascale_transfer_type="ALL_REDUCE", ...}
    %recv = (f32[8,4,128]{...}, u32[], token[]) recv(%after-all), ...   (the same rendezvous)
    %recv-done = (f32[8,4,128]{...}, token[]) recv-done(%recv)          (the reduced shard)

(measured, libtpu 0.0.50.1, v5e:2x2 and v5e:16x16 at 2 and 32 slices). The mesh of such a program
puts the axes across slices outermost (jax.experimental.mesh_utils.create_hybrid_device_mesh), so
`slice_mesh` splits a mesh into those DCN axes and one slice's mesh, and `transfers` reads each
pair as one record of the ledger over the DCN axes: the `send` carries the bytes, the `recv-done`
completes it (twinshard/hlo/schedule.py times the window between).
"""

from __future__ import annotations

import math
import re

from twinshard.hlo.groups import MeshSpec
from twinshard.hlo.parse import Instr, Module, parse_shape

# _xla_megascale_transfer_type -> the collective it is
TRANSFER_OPS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
                "ALL_TO_ALL": "all-to-all"}
# _xla_megascale_reduce_operation -> the ledger's reduction
TRANSFER_REDUCTIONS = {"SUM": "sum", "MAX": "max", "MIN": "min", "PRODUCT": "product"}


def slice_mesh(mod: Module, spec: MeshSpec) -> tuple[MeshSpec, tuple[str, ...]]:
    """(one slice's mesh, the DCN axes): the outermost axes of `spec` whose product is spec.size /
    num_partitions, in a program with megascale transfers; (spec, ()) for a program of the whole mesh.
    ValueError naming the mesh otherwise (a mesh too big for a program of one slice is a wrong mesh)."""
    n = mod.num_partitions
    if n in (None, 1) or n == spec.size:
        return spec, ()
    crosses = any(is_transfer(i) for instrs in mod.computations.values() for i in instrs)
    for k in range(1, len(spec.names)):
        if crosses and math.prod(spec.shape[:k]) * n == spec.size:
            return MeshSpec(spec.names[k:], spec.shape[k:]), spec.names[:k]
    why = "no outer axes of it hold" if crosses else "no megascale transfer makes it one slice's program of"
    raise ValueError(f"the program has num_partitions={n} but the mesh {dict(zip(spec.names, spec.shape))} has "
                     f"{spec.size} devices, and {why} {n} devices each: pass the mesh it was compiled for (a "
                     "multi-slice program's: the axes across slices outermost)")


TRANSFER_OPCODES = ("send", "recv", "send-done", "recv-done")


def is_transfer(instr: Instr) -> bool:
    """A send or recv the megascale runtime carries between slices."""
    return instr.opcode in ("send", "recv") and "xla_megascale_runtime" in instr.attr_text


def is_transfer_side(instr: Instr) -> bool:
    """A send, recv or their done to or from the host (is_host_transfer): a megascale transfer's, as a
    multi-slice program prints them (the dones carry no handler name)."""
    return instr.opcode in TRANSFER_OPCODES and "is_host_transfer=true" in instr.attr_text


def attribute(instr: Instr, name: str) -> str:
    m = re.search(rf'\b{name}="([^"]*)"', instr.attr_text)
    return m.group(1) if m else ""


def rendezvous(instr: Instr) -> str:
    """The transfer a send / recv belongs to (its pair shares it)."""
    return attribute(instr, "_xla_host_transfer_rendezvous")


def transfer_op(instr: Instr) -> str:
    """The collective a megascale send carries; ValueError for a transfer type this reader does not know."""
    kind = attribute(instr, "_xla_megascale_transfer_type")
    if kind not in TRANSFER_OPS:
        raise ValueError(f"megascale transfer type {kind!r} (known: {', '.join(TRANSFER_OPS)})")
    return TRANSFER_OPS[kind]


def payload(instr: Instr):
    """The array a send or recv moves: the first element of its (array, u32[], token[]) result."""
    shape = parse_shape(instr.shape_text)
    return shape[0] if isinstance(shape, list) else shape


def transfer_record(send: Instr, dcn_axes: tuple[str, ...], dcn_size: int, mult: tuple[int, bool, bool],
                    op_name: str, source: str):
    """The ledger's record of the collective a megascale `send` carries over the DCN axes (its recv,
    of the same rendezvous, is the other half and gets none). The send's operand is this chip's part:
    the ring runs over the `dcn_size` slices, one chip from each."""
    from twinshard.hlo.records import Collective, ring_bytes  # records reads this module

    op, array = transfer_op(send), payload(send)
    reduction = TRANSFER_REDUCTIONS.get(attribute(send, "_xla_megascale_reduce_operation"), "")
    return Collective(op=op, dtype=array.dtype, shape=array.dims, bytes=array.bytes,
                      ring_bytes=ring_bytes(op, array.bytes, dcn_size), replica_groups=(), source_target_pairs=(),
                      axes=dcn_axes, partial_axes=(), group_size=dcn_size, multiplicity=mult[0], source=source,
                      op_name=op_name, name=send.name, computation=send.computation, is_async=True,
                      multiplicity_exact=mult[1], reduction=reduction if op in ("all-reduce", "reduce-scatter") else "")
