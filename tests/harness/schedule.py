"""How pytest-xdist deals the suite out to its workers: one module per worker, costliest first.

pyproject.toml runs `-n 2 --dist loadgroup --no-loadscope-reorder`; tests/conftest.py imports
the two hooks below. Each module is one group (SHARED_GROUPS joins modules that compile the same
programs), so its cached runners and module fixtures are built on ONE worker (under `--dist
load` a module's tests were spread over both workers and each built them: test_readme ran every
README command twice). The groups start costliest first (COLD_SECONDS); the modules in UNGROUPED
hold independent tests and are dealt out one at a time, last, to even out the finish.

A new module needs no entry: it is a group of DEFAULT_SECONDS. Listing its cold time only moves
it in the queue.
"""

import os
import pathlib

# Wall seconds of each group on a cold compilation cache (a fresh clone's profiled run, 2 workers
# on 2 cores); only the order matters: the scheduler hands out the costliest group first.
COLD_SECONDS = {
    "test_twins": 230, "test_readme": 170, "test_pipeline": 100, "test_train": 95, "test_accum": 85,
    "test_context": 80, "test_multiprocess": 70, "test_optimizers": 60, "test_scan": 45, "test_tpu_topology": 45,
    "test_precision": 40, "test_wheel": 40, "test_bf16_parallel": 180, "test_collectives_cli": 30, "test_bench": 25,
    "test_experts": 150, "test_shards": 22, "test_explicit": 100, "test_gqa": 110,
    # ungrouped: their tests are dealt out after the groups, the slowest module's first
    "test_attention": 20, "test_model": 20, "test_readme_snippet": 17, "test_loss_optim": 11, "test_layers": 10,
    "test_cli_errors": 2,
}
DEFAULT_SECONDS = 30  # a group not listed (an ungrouped module not listed: 0, cheap)
# Modules of independent tests (no shared runner or costly module fixture): not grouped.
UNGROUPED = {
    "test_layers", "test_loss_optim", "test_attention", "test_model", "test_cli_errors",
    "test_validation", "test_mesh", "test_plan", "test_cost", "test_data", "test_bpe", "test_tokenizer",
    "test_readme_snippet", "test_hlo", "test_hlo_input", "test_compile_cache", "test_harness", "test_mutate",
    "test_strategies", "test_same_programs",
}
# Modules that build the same runners (tests/runners.py's CFG) share one group, so they run on one
# worker, one after the other: test_sequence reuses test_data_tensor's single-device record in
# process (functools.cache), and the others find its programs in the persistent cache (whose key
# leaves out source locations: tests/harness/cache.py) without waiting for the other worker.
SHARED_GROUPS = {**{m: "test_twins" for m in ("test_data_tensor", "test_memory", "test_remat", "test_sequence")},
                 "test_pipeline_ticks": "test_pipeline", "test_tick_prices": "test_pipeline",  # its compiled steps
                 # tiny_moe's single-device init and dropless gradients, compiled by test_experts
                 **{m: "test_experts" for m in ("test_ragged", "test_moe")}}


def group_of(module: str) -> str | None:
    """The xdist group of a test module (None: its tests are dealt out one by one)."""
    return None if module in UNGROUPED else SHARED_GROUPS.get(module, module)


def module_of(nodeid: str) -> str:
    return pathlib.PurePath(nodeid.split("::")[0]).stem


def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup, with the groups taken from group_of() instead of xdist_group marks.

    Measured (pytest 9.2, pytest-xdist 3.8): xdist's own loadgroup puts the group into the
    node id by setting `item._nodeid`, which pytest 9 no longer reads (`item.nodeid` comes
    from `item._id`), so every group's tests were spread over both workers as under --dist
    load. This scheduler reads the module from the node id itself."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(module_of(nodeid)) or nodeid

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config, items):
    """xdist workers only (the scheduler deals out their collection order): the costliest groups
    first, the ungrouped tests last, to fill the tail. A stable sort; a plain pytest run (and
    tools/mutate.py's, which lists the cheapest tests first) keeps the command line's order."""
    def cost(item):
        group = group_of(module_of(item.nodeid))
        return group is None, -COLD_SECONDS.get(group or module_of(item.nodeid), DEFAULT_SECONDS if group else 0)

    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=cost)
