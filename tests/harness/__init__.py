"""What makes the test suite fast, in one place; nothing here changes what a test asserts.

Why: the suite is compile time and process start-up (a cold CI clone compiles every program,
and the launcher tests start ~50 Python processes), on 2 cores with a 15-minute budget.

- speed.py: one bytecode cache for every test process (imports 8.7-9.1 s of CPU -> 2.8-3.5 s
  per process), and a GC tuned for tracing (4.5 s -> 1.6 s of 52 s in two modules).
- schedule.py: pytest-xdist deals out whole modules, costliest first, so a module's cached
  runners are built once, on one worker, and the tail is filled with small independent tests.
- zygote.py + forked.py: launcher commands are forked from a Python that has imported jax,
  flax, optax and orbax once (~2.8 s of CPU per command otherwise).
- cache.py: the persistent compilation cache, keyed by the library's sources, with the source
  locations left out of each program's key: a step compiled twice (trained, then lowered for
  its ledger) compiles once (tests/test_experts.py cold: 124 s -> 93 s).
- markers.py: a marker per declared strategy (`pytest -m fsdp`), read from the tests' names,
  parameters and modules.
- suite_profile.py: `TWINSHARD_SUITE_PROFILE=FILE pytest` says where the time goes, in wall and
  CPU seconds per test and per launcher (a tool, off by default).

Measured and not kept: XLA:CPU compile options (jaxlib 0.12.0.1; the train steps of auto and manual
fsdp_tp on data:2,tensor:4, manual pp on 4 stages and manual ep, 1.7-2.7 CPU-s each at opt level 0,
7.3-8.4 s for the four in two runs at the default). --xla_llvm_disable_expensive_passes (7.8 s),
--xla_cpu_parallel_codegen_split_count=1 (7.9), --xla_cpu_enable_fast_min_max (8.3) and
--xla_cpu_use_xnnpack=false (8.1) were within that noise, every collective unchanged;
--xla_cpu_max_isa=SSE4_2 was slower; --xla_cpu_use_fusion_emitters is not a flag of this jaxlib (an
unknown XLA flag aborts the process). perf: the compile is spread over XLA's HLO and MLIR passes, no
LLVM pass stands out, and ~40% of a test process's samples are Python. The persistent cache's 0.5 s
floor stays: in test_remat's profile (a loaded machine) 4 of 55 cold programs compiled in under it.

What cut compile seconds is compiling fewer programs (cold compilation cache, CPU seconds of the test
process and its children; the machine shared, so each figure is one run, ~10% noise):
    test_xla_options     37.9 -> 17.6  one compile per option set; libtpu's check of the names is
                                       one compile with all of them (22 -> 10 programs)
    test_speed_options   28.8 -> 15.1  (its 3 splash tests) the layout and kernel-option tests read
                                       the same two v5e steps (4 -> 2 AOT compiles)
    test_tpu_bench       29.6 -> 22.8  its launchers get tests/cli.py's environment (they compiled
                                       at the full backend optimization level)
    test_remat           -7.8 of 118   cp's ledger under remat read from the programs its gradients
                                       compile; ulysses's held by test_ulysses (2 compiles fewer)
    tests/runners.py     13.5 -> 12.0  (test_remat's manual tp) initial params on the host: no
                                       jit(_multi_slice) to place them on a mesh

Measured gain, fresh clone, `bash .ci/run`, 2-core EPYC VM: with this harness 691 s, 718 s and
750 s (963-964 tests, three runs); plain pytest-xdist (`-n 2 --dist loadfile`, every command a
fresh `python`: TWINSHARD_TEST_FORK=0) 846 s. cache.py then took 1074 tests to 629 s (1599 ->
1226 worker seconds; BENCHMARKS.md). Each piece is measured above on its own; the zygote and
the scheduler were measured only together.
"""
