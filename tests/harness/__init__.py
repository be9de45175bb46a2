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
- suite_profile.py: `TWINSHARD_SUITE_PROFILE=FILE pytest` says where the time goes (a tool,
  off by default).

Measured gain, fresh clone, `bash .ci/run`, 2-core EPYC VM: with this harness 691 s, 718 s and
750 s (963-964 tests, three runs); plain pytest-xdist (`-n 2 --dist loadfile`, every command a
fresh `python`: TWINSHARD_TEST_FORK=0) 846 s. cache.py then took 1074 tests to 629 s (1599 ->
1226 worker seconds; BENCHMARKS.md). Each piece is measured above on its own; the zygote and
the scheduler were measured only together.
"""
