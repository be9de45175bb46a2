"""The test harness (tests/harness/): a command forked from the zygote behaves as a fresh
`python ARGV...` does: the same exit code, stdout and stderr for what a program can observe of
its start and end."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import cli
from harness import cache, forked, suite_profile

PROGRAM = r"""
import atexit, os, sys, tempfile, threading, time
print("argv", sys.argv[1:], "path0", repr(sys.path[0]), "cwd", os.getcwd() == sys.argv[1])
print("env", os.environ.get("TWINSHARD_FORK_CHECK"), "tmp", tempfile.gettempdir() == sys.argv[1])
print("stdin", repr(sys.stdin.read()))
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined", flush=True))).start()
mode = sys.argv[2]
if mode == "exit":
    sys.exit(3)
if mode == "message":
    sys.exit("a message")
if mode == "raise":
    raise ValueError("boom")
print("done")
"""


def fresh(argv, tmp_path):
    return subprocess.run([sys.executable, *argv], cwd=tmp_path, env=cli.env(**extra(tmp_path)),
                          capture_output=True, text=True, timeout=60)


def extra(tmp_path) -> dict[str, str]:
    return {"TWINSHARD_FORK_CHECK": "yes", "TMPDIR": str(tmp_path)}


@pytest.mark.parametrize("mode", ["ok", "exit", "message", "raise"])
def test_a_forked_program_sees_what_a_fresh_python_sees(tmp_path, mode):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    for argv in (["-c", PROGRAM, str(tmp_path), mode], [str(script), str(tmp_path), mode]):
        forked = cli.run(*argv, cwd=tmp_path, timeout=60, **extra(tmp_path))
        want = fresh(argv, tmp_path)
        assert (forked.returncode, forked.stdout, forked.stderr) == (want.returncode, want.stdout, want.stderr)
    assert forked.returncode == {"ok": 0, "exit": 3, "message": 1, "raise": 1}[mode]
    assert "thread joined" in forked.stdout and "atexit ran" in forked.stdout


def test_a_module_runs_as_main_with_the_cwd_first_on_the_path(tmp_path):
    (tmp_path / "probe_module.py").write_text("import sys\nprint(__name__, sys.argv[0].endswith('probe_module.py'), "
                                              "repr(sys.path[0]))\n")
    forked = cli.run("-m", "probe_module", cwd=tmp_path)
    want = fresh(["-m", "probe_module"], tmp_path)
    assert forked.stdout == want.stdout == f"__main__ True {str(tmp_path)!r}\n"


def test_a_jax_variable_gets_a_fresh_python(monkeypatch):
    monkeypatch.setenv("TWINSHARD_TEST_FORK", "1")
    assert forked.may_fork(cli.env(), cli.env())
    assert not forked.may_fork(cli.env(JAX_LOG_COMPILES="1"), cli.env())  # jax reads JAX_* at import
    monkeypatch.setenv("TWINSHARD_TEST_FORK", "0")
    assert not forked.may_fork(cli.env(), cli.env())


def gone(pid: int) -> bool:
    """The process has ended (a zombie counts: it runs nothing; an orphan waits for init's reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_command_past_its_timeout_is_killed_with_its_children(tmp_path):
    """cli.run's timeout path (forked.finish) kills a command that outlives it, and the command's
    own child too. The timeout starts once the command has started its child (the test reads
    its 'started' line first, however long a loaded machine takes), so nothing here depends
    on how fast a process starts; the waits are hang guards."""
    code = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(3600)']); print('started', child.pid, flush=True); time.sleep(3600)")
    command = forked.Child(["-c", code], tmp_path, cli.env(), forked.Zygote.get(cli.env(), cli.ROOT))  # as run()
    line = next(command.stdout)
    assert line.startswith("started ")
    grandchild = int(line.split()[1])
    assert not gone(grandchild)
    with pytest.raises(subprocess.TimeoutExpired) as err:
        forked.finish(command, timeout=0.1)
    assert err.value.output == line and command.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 60  # a hang guard: SIGKILL of the session ends it at once
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(grandchild)
    assert cli.run("-c", "print('next')").stdout == "next\n"  # the zygote still serves


def test_the_compilation_cache_is_keyed_by_the_library_sources(tmp_path, monkeypatch):
    """Any edit to a library file names a new cache directory (tests/harness/cache.py): no cached
    executable outlives the source locations it carries. prune deletes the others that are days old."""
    (tmp_path / "manual_parallel").mkdir()
    (tmp_path / "manual_parallel" / "a.py").write_text("x = 1\n")
    before = cache.source_key(tmp_path)
    (tmp_path / "manual_parallel" / "a.py").write_text("x = 1\n\n")  # one blank line moves every location below
    edited = cache.source_key(tmp_path)
    assert edited != before
    for outside in ("tests", "launch", "twinshard/cost"):  # code whose lines no program carries
        (tmp_path / outside).mkdir(parents=True)
        (tmp_path / outside / "b.py").write_text("y = 2\n")
    assert cache.source_key(tmp_path) == edited
    (tmp_path / "manual_parallel" / ".#a.py").symlink_to("nowhere")  # an editor's lock file: skipped
    assert cache.source_key(tmp_path) == edited
    monkeypatch.setattr(cache, "ROOT", tmp_path)
    jax_cache = tmp_path / ".cache" / "jax"
    for old in ("0123456789abcdef", "jit_step-abc-cache", "recent0123456789"):
        (jax_cache / old).mkdir(parents=True)
    for old in ("0123456789abcdef", "jit_step-abc-cache"):  # last written 4 days ago
        os.utime(jax_cache / old, (time.time() - 4 * 86400,) * 2)
    keep = jax_cache / "fedcba9876543210"
    keep.mkdir()
    cache.prune(keep)
    assert sorted(p.name for p in jax_cache.iterdir()) == [keep.name, "recent0123456789"]


KEYED = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_compilation_cache_dir", sys.argv[2])
jax.config.update("jax_persistent_cache_min_compile_time_secs", float(sys.argv[3]))
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from harness import suite_profile
programs = suite_profile.record_programs()
second = suite_profile.record_programs()  # a second recorder of the process sees the same keys
f = lambda x: jnp.sin(x) * 3.0 + 0.125
for n in (7, 7, 9):  # the same program twice (its executable dropped between), then another shape
    jax.jit(f).lower(np.ones(n, np.float32)).compile()
    jax.clear_caches()
rows = [{"test": "t", "compiled": programs}]
assert second == programs, (second, programs)
print(json.dumps({"programs": programs, "twice": suite_profile.compiled_twice(rows)}))
"""


@pytest.mark.parametrize("floor, cold", [(60.0, 3), (0.0, 2)])
def test_the_suite_profile_keys_each_cold_compile_and_names_a_program_compiled_twice(tmp_path, floor, cold):
    """tests/harness/suite_profile.py records each cold compile with its persistent-cache key. A program under the
    cache's floor of compile seconds is not written to the cache, so dropping its executable compiles it cold
    again, under the same key: compiled_twice names it. Above the floor, the second compile is a cache hit and
    nothing is listed twice."""
    done = subprocess.run([sys.executable, "-c", KEYED, str(cli.ROOT / "tests"), str(tmp_path / "cache"), str(floor)],
                          capture_output=True, text=True, timeout=120, env=cli.env())
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    keys = [key for _, _, key in got["programs"]]
    assert len(keys) == cold and all(keys) and len(set(keys)) == 2, got
    twice = list(got["twice"].values())
    assert [[t for t, _ in where] for where in twice] == ([["t", "t"]] if cold == 3 else []), got
    if twice:  # the repeat's seconds: the shorter of the two compiles
        assert suite_profile.repeated_seconds(twice[0]) == pytest.approx(min(s for _, s in twice[0]), abs=1e-9)
        assert min(s for _, s in twice[0]) > 0
