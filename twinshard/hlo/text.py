"""What the ledger reads: the HLO module text of a compiled program, and nothing else.

`hlo_text` takes a `jax.stages.Compiled` (or its text) and refuses a function, a `Lowered`, StableHLO;
`parsed_module` parses the text, refusing HLO that XLA has not compiled yet.
"""

from __future__ import annotations

import re
from typing import Any

from twinshard.hlo.parse import Module, parse_module


class NotCompiledHLO(ValueError, TypeError):
    """`ledger` was given something that is not the optimized HLO of a compiled program (also a TypeError)."""


_PASS_COMPILED = "pass `jax.jit(f).lower(*args).compile()` (a jax.stages.Compiled) or its `.as_text()`"
# StableHLO / MLIR text (`lowered.as_text()`), e.g. `module @jit_f attributes {...` or
# `%0 = stablehlo.sine %arg0`; no line of HLO text starts like these.
_MLIR = re.compile(r'^\s*(?:module\s+(?:@|attributes\b)|func\.func\b'
                   r'|%[\w#:]+\s*=\s*"?(?:stablehlo|mhlo|sdy|func)\.)', re.M)
# HLO of a `Lowered` before compilation (not partitioned yet): measured, JAX 0.12, it holds
# `xla.sdy.` markers, which no compiled module prints (CPU, shard_map and the v5e:4x4 AOT compiles);
# the other three are GSPMD's markers when Shardy is off (inferred, not seen here).
_UNCOMPILED = re.compile(r'xla\.sdy\.|custom_call_target="(?:Sharding|SPMDFullToShardShape|SPMDShardToFullShape)"')
# A compiled module is scheduled; JAX 0.10.2's compiled programs keep Shardy's mesh in the module's own
# attributes (`frontend_attributes={xla.sdy.meshes=...}`, measured), so those markers alone prove nothing.
_SCHEDULED = re.compile(r"^HloModule[^\n]*\bis_scheduled=true", re.M)


def is_scheduled(text: str) -> bool:
    """Whether HLO module text is a scheduled (compiled) module: its header says is_scheduled=true."""
    return bool(_SCHEDULED.search(text))


def hlo_text(compiled_or_text: Any) -> str:
    """The HLO module text of a `Compiled` (or the text itself); anything else is refused."""
    obj, kind = compiled_or_text, type(compiled_or_text).__name__
    if isinstance(obj, str):
        return obj
    if hasattr(obj, "compile"):  # jax.stages.Lowered (a Compiled has no .compile)
        raise NotCompiledHLO(f"ledger got a {kind}, which is not compiled yet (XLA inserts the "
                             f"collectives when it compiles): call its `.compile()`; {_PASS_COMPILED}.")
    if hasattr(obj, "lower"):  # a jitted function or jax.stages.Traced
        raise NotCompiledHLO(f"ledger got a {kind} (a function, not a compiled program); {_PASS_COMPILED}.")
    text = obj.as_text() if hasattr(obj, "as_text") else None
    if not isinstance(text, str):
        raise NotCompiledHLO(f"ledger got a {kind}; {_PASS_COMPILED}.")
    return text


def parsed_module(text: str) -> Module:
    """Parse HLO module text, refusing text that is not a compiled program's HLO."""
    if _MLIR.search(text):
        raise NotCompiledHLO(
            "ledger got StableHLO/MLIR text (what `jax.jit(f).lower(x).as_text()` returns, before XLA "
            f"compiles and partitions the program, so before its collectives exist); {_PASS_COMPILED}.")
    if not text.strip():
        raise NotCompiledHLO(f"ledger got empty text; {_PASS_COMPILED}.")
    if _UNCOMPILED.search(text) and not is_scheduled(text):
        raise NotCompiledHLO(
            "ledger got HLO that XLA has not compiled yet (it still carries xla.sdy / sharding "
            "custom-calls, as `lowered.as_text(dialect='hlo')` prints); the collectives of a "
            f"GSPMD program exist only after compilation: {_PASS_COMPILED}.")
    mod = parse_module(text)
    if not any(mod.computations.values()):
        raise NotCompiledHLO(f"ledger read no HLO instruction in this text (it starts "
                             f"{text.strip()[:60]!r}): it is not an HLO module; {_PASS_COMPILED}.")
    return mod
