"""The twin tests' canonical config and meshes, shared so that their programs are too.

A cold CI clone compiles every program of the suite (1-5 s each). Two test modules that
build a runner from the SAME config and mesh compile the same train step, and the second
loads it from the persistent compilation cache (tests/conftest.py) instead of compiling
it again; modules of one xdist group (conftest's SHARED_GROUPS) run one after the other,
so the cache is warm when the second one needs it. Use CFG and MESHES for a new twin test
unless it needs another config (and then say which field, and why, where it is defined).

CFG: the tiny preset with num_heads 8 (head_dim 8), so tp and fsdp_tp split the heads
over a tensor axis of 8 or 4; grad_clip 0.25 is below the gradient norm (~0.7 at init,
measured), so every step runs the clipped branch and the twins' global norms (manual: a
psum of partial squared norms) must agree with single device for the updates to agree.
"""

import dataclasses

from twinshard.config import Config, preset

BASE = preset("tiny")
CLIP = 0.25
CFG = Config(dataclasses.replace(BASE.model, num_heads=8), dataclasses.replace(BASE.train, grad_clip=CLIP))
# every strategy on all 8 devices (dp, fsdp, tp: the strategy's default mesh)
MESHES = {"dp": "data:8,tensor:1", "fsdp": "data:8,tensor:1", "tp": "data:1,tensor:8",
          "fsdp_tp": "data:2,tensor:4"}
