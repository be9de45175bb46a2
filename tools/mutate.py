"""Mutation testing: apply each curated bug (tests/mutants/) to a copy of the
tree, run the tests that should catch it, and report caught / missed.

    uv run python tools/mutate.py                     # every mutant (~40 min on 2 busy cores)
    uv run python tools/mutate.py --only ID[,ID]      # some mutants
    uv run python tools/mutate.py --category optim    # one category
    uv run python tools/mutate.py --list              # the list; says which snippets no longer apply
    uv run python tools/mutate.py --check             # the same, exit 1 if one is stale
    uv run python tools/mutate.py --json out.json --markdown out.md
    uv run python tools/mutate.py --keep-going --only ID # no -x: every test that catches it

The developer's working tree is never written: the tree (`git ls-files`: tracked
files plus untracked, non-ignored ones) is read once at the start, and each
mutant runs in a fresh copy of that snapshot in a fixed per-repo directory under
the system temp dir, with the repo's `.venv` (symlinked) and the developer's test
compilation cache (tests/harness/cache.py) shared. At the end every file of the tree is compared with the
snapshot and the report says "working tree unchanged (N files verified)" (or
names the files someone edited meanwhile: the results are for the snapshot).

Results per mutant:
    caught          the selected tests failed
    caught (error)  pytest could not collect or import the tests (the mutant only broke
                    imports or syntax: counted as caught, shown apart so it stays visible)
    caught (timeout) the tests ran past the per-mutant timeout (counted as caught: a hang
                    is a failure a developer sees; the timeout is 4x the baseline time of
                    the selected test files, at least 180 s, so slowness alone does not trip it)
    missed          the selected tests passed: a gap in the tests
    equivalent      the mutant is known not to change behaviour (its `equivalent` reason);
                    not run unless --run-equivalent, then `equivalent (missed)` confirms the
                    label and `equivalent (caught)` says the label is wrong
    stale           the original snippet does not occur exactly once in its file nor in any one
                    other Python file (code that moved unchanged is followed), or the mutated
                    file is not valid Python: fix the mutant
Exit status: 0 when every non-equivalent mutant is caught, 1 otherwise (missed or stale,
or an equivalent label disproved), 2 on bad arguments or a failing baseline.

Before mutating, every selected test runs once on the unmutated copy, in one
pytest run over the union of the selections (skip with --no-baseline): a test that
fails there would make its mutants look caught, so the run aborts naming them. The
baseline also warms the compilation cache for the scratch path and times each test
file (the timeouts above).

Measured (JAX 0.12): the persistent compilation cache key strips source locations by
default, so a mutant that changes only which line a collective comes from (e.g. the
Megatron f removed before lm_head, whose psum autodiff then inserts itself) would
load the unmutated program's executable, with the unmutated source metadata, from
the cache. Runs here set JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY=true and use a
fixed tree path, so cached entries are reused across mutants only when the program
and its source locations are identical.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from xml.etree import ElementTree

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from harness import cache  # noqa: E402  (stdlib only)
from mutants import MUTANTS, Mutant  # noqa: E402  (tests/mutants/, one module a family)

MUTANTS_DIR = "tests/mutants/"  # where the snippets are quoted: never a place a mutant applies to

TEST_CACHE = cache.directory()  # the developer's tree's, shared by every mutant's run
PYTEST_ARGS = ("-x", "-q", "-n", "0", "-p", "no:cacheprovider")
MIN_TIMEOUT_S = 180
DEFAULT_TIMEOUT_S = 1200  # per mutant, when there is no baseline time to scale
CAUGHT = ("caught", "caught (error)", "caught (timeout)")


@dataclasses.dataclass
class Result:
    mutant: Mutant
    result: str
    first_failure: str = ""
    seconds: float = 0.0
    detail: str = ""
    failures: tuple[str, ...] = ()  # every failing test (all of them only with --keep-going)

    def row(self) -> dict:
        m = self.mutant
        return {"id": m.id, "category": m.category, "file": m.file, "result": self.result,
                "first_failure": self.first_failure, "seconds": round(self.seconds, 1),
                "failures": list(self.failures), "tests": list(m.tests), "description": m.description,
                "detail": self.detail}


# ----------------------------------------------------------------------------- the tree


def tree_files(root: pathlib.Path = ROOT) -> list[str]:
    """Tracked files plus untracked, non-ignored ones (what a commit would see), that exist."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=root, capture_output=True, check=True).stdout.decode()
    return sorted({p for p in out.split("\0") if p and (root / p).is_file()})


def snapshot(files: list[str], root: pathlib.Path = ROOT) -> dict[str, tuple[bytes, int]]:
    """The tree's files as (bytes, mode), read once: every mutant starts from this, so
    editing the working tree during a run does not change what the run tests."""
    return {p: ((root / p).read_bytes(), (root / p).stat().st_mode & 0o777) for p in files}


def changed_files(snap: dict[str, tuple[bytes, int]], root: pathlib.Path = ROOT) -> list[str]:
    """Files of the snapshot whose bytes differ in (or are gone from) the working tree now: tracked
    files and untracked Python files. An untracked non-Python file (a log the suite's own output is
    written to: `bash .ci/run > ci.log`) changes nothing a test reads."""
    tracked = set(subprocess.run(["git", "ls-files", "-z", "--cached"], cwd=root, capture_output=True,
                                 check=True).stdout.decode().split("\0"))
    return [p for p, (data, _) in snap.items() if (p in tracked or p.endswith(".py"))
            and (not (root / p).is_file() or (root / p).read_bytes() != data)]


def locate(m: Mutant, snap: dict[str, tuple[bytes, int]]) -> str | None:
    """The file the mutant applies to: `m.file` when its snippet occurs there exactly once; else
    the one Python file of the tree where it does (the code moved unchanged); else None."""
    if m.file in snap and snap[m.file][0].decode().count(m.original) == 1:
        return m.file
    hits = [p for p, (data, _) in snap.items()
            if p.endswith(".py") and not p.startswith(MUTANTS_DIR) and data.decode().count(m.original) == 1]
    return hits[0] if len(hits) == 1 else None


def stale_reason(m: Mutant, snap: dict[str, tuple[bytes, int]]) -> str:
    """'' if the mutant applies (snippet exactly once in one file, result valid Python), else why not."""
    where = locate(m, snap)
    if where is None:
        n = snap[m.file][0].decode().count(m.original) if m.file in snap else 0
        return (f"original snippet occurs {n} times in {m.file} and not exactly once in any one "
                f"other Python file of the tree")
    text = snap[where][0].decode()
    try:
        compile(text.replace(m.original, m.replacement), where, "exec")
    except SyntaxError as e:
        return f"the mutated {where} is not valid Python: {e}"
    missing = [t for t in m.tests if t.split("::")[0] not in snap]
    if missing:
        return f"test file(s) {missing} do not exist"
    return ""


class Slot:
    """One scratch copy of the tree; --jobs N uses N of them. The path is fixed per repo
    and slot (see the module docstring: source paths are part of the cache key)."""

    def __init__(self, index: int, snap: dict[str, tuple[bytes, int]]):
        tag = hashlib.sha256(str(ROOT).encode()).hexdigest()[:8]
        self.base = pathlib.Path(tempfile.gettempdir()) / f"twinshard-mutate-{tag}" / f"slot{index}"
        self.tree = self.base / "tree"
        self.snap = snap
        self.base.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.base / "lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            die(f"{self.base} is in use by another tools/mutate.py run on this repo; "
                     "wait for it to finish (or pass a smaller --jobs).")

    def fresh_copy(self, mutant: Mutant | None) -> None:
        """A pristine copy of the tree (no __pycache__, no outputs of earlier runs), then the mutant."""
        if self.tree.exists():
            shutil.rmtree(self.tree)
        for p, (data, mode) in self.snap.items():
            dst = self.tree / p
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
            dst.chmod(mode)
        (self.tree / ".cache").mkdir()
        (self.tree / ".venv").symlink_to(ROOT / ".venv")
        if mutant is not None:
            path = self.tree / locate(mutant, self.snap)  # not None: checked by stale_reason
            text = path.read_text()
            path.write_text(text.replace(mutant.original, mutant.replacement))

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
        # The venv's editable install puts the developer's tree on sys.path; the copy goes first.
        env["PYTHONPATH"] = str(self.tree)
        # The developer's compilation cache (tests/harness/cache.py), with the source locations in the
        # key: a mutant that moves the line asking for a collective must not read the original's.
        env["TWINSHARD_TEST_CACHE"] = str(TEST_CACHE)
        env["JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY"] = "true"
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # no .pyc of a mutated file, ever: tests/conftest.py and
        env["TWINSHARD_READ_ONLY_BYTECODE"] = "1"  # tests/cli.py keep the first when they see this
        # ...but read the developer's bytecode cache: the venv's packages (jax, flax, ...; never
        # mutated) have their .pyc there, the copy's own files none (their path is the copy's).
        # Measured: a fresh process imports jax, flax, optax, orbax in 8.7-9.1 s of CPU without.
        env["PYTHONPYCACHEPREFIX"] = str(ROOT / ".cache" / "pycache")
        return env

    def check_imports_resolve_here(self) -> None:
        code = "import twinshard, auto_parallel, manual_parallel, launch; print(twinshard.__file__)"
        out = subprocess.run([python(), "-c", code], cwd=self.tree, env=self.env(),
                             capture_output=True, text=True)
        where = out.stdout.strip()
        if out.returncode or not where.startswith(str(self.tree)):
            die(f"the scratch copy's packages do not import from the copy "
                     f"(twinshard from {where or out.stderr[-500:]!r}); mutants would test the wrong code.")

    def pytest(self, tests: tuple[str, ...], timeout: float, extra: tuple[str, ...] = (),
               stop_first: bool = True) -> tuple[int | None, str, float]:
        """(return code or None on timeout, output, seconds)."""
        args = PYTEST_ARGS if stop_first else tuple(a for a in PYTEST_ARGS if a != "-x")
        cmd = [python(), "-m", "pytest", *args, *extra, *tests]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=self.tree, env=self.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        with _RUNNING_LOCK:
            _RUNNING.add(proc)
            if _STOP.is_set():
                _kill(proc)
        try:
            out, _ = proc.communicate(timeout=timeout)
            return proc.returncode, out, time.perf_counter() - t0
        except subprocess.TimeoutExpired:
            _kill(proc)
            out, _ = proc.communicate()
            return None, out, time.perf_counter() - t0
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(proc)

    def close(self) -> None:
        shutil.rmtree(self.tree, ignore_errors=True)
        self._lock.close()


def die(message: str) -> None:
    """Bad arguments, a broken setup or a failing baseline: exit status 2."""
    print(f"mutate: {message}", file=sys.stderr)
    sys.exit(2)


_RUNNING: set[subprocess.Popen] = set()
_RUNNING_LOCK = threading.Lock()
_STOP = threading.Event()  # set on Ctrl-C


def _kill(proc: subprocess.Popen) -> None:
    """The test process and its children (launcher subprocesses): its own session's group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def python() -> str:
    exe = ROOT / ".venv" / "bin" / "python"
    if not exe.is_file():
        die(f"{exe} not found; create it first: "
                 "`UV_PYTHON_DOWNLOADS=never uv sync --locked --extra tpu`.")
    return str(exe)


# ----------------------------------------------------------------------------- pytest output


# `FAILED tests/test_hlo.py::test_formats[iota transposed] - AssertionError: ...` (ids may hold spaces)
_SUMMARY = re.compile(r"^(FAILED|ERROR) (.+?)(?: - .*)?$")


def first_failure(output: str) -> str:
    """The first FAILED/ERROR node id of pytest's short summary (-ra), else a hint."""
    for line in output.splitlines():
        m = _SUMMARY.match(line)
        if m:
            return m.group(2) + (" (error)" if m.group(1) == "ERROR" else "")
    tail = [ln for ln in output.splitlines() if ln.strip()]
    return tail[-1][:120] if tail else ""


def classify(rc: int | None, output: str) -> tuple[str, str]:
    """pytest exit code -> (result, first failing test). 0 passed, 1 tests failed,
    2 interrupted (collection errors), 3 internal error, 4 usage error, 5 nothing collected."""
    if rc is None:
        return "caught (timeout)", ""
    if rc == 0:
        return "missed", ""
    if rc == 1:
        return "caught", first_failure(output)
    if rc in (2, 3):
        return "caught (error)", first_failure(output)
    return "error", f"pytest exit {rc}: " + first_failure(output)


# ----------------------------------------------------------------------------- the run


def baseline(slot: Slot, mutants: list[Mutant]) -> dict[str, float]:
    """Run every selected test once on the unmutated copy (one pytest run over the union
    of the selections, without -x); abort naming the selections that fail. Returns the
    seconds per test file (junit times), from which each mutant's timeout is scaled."""
    slot.fresh_copy(None)
    slot.check_imports_resolve_here()
    entries = list(dict.fromkeys(t for m in mutants for t in m.tests))
    whole = {e for e in entries if "::" not in e}
    entries = [e for e in entries if e in whole or e.split("::")[0] not in whole]
    junit = slot.base / "baseline.xml"
    print(f"baseline: {len(entries)} test files/ids on the unmutated tree ...", flush=True)
    rc, out, secs = slot.pytest(tuple(entries), DEFAULT_TIMEOUT_S * 2, extra=("--junitxml", str(junit)),
                                stop_first=False)
    failing = [m.group(2) for m in map(_SUMMARY.match, out.splitlines()) if m]
    if rc != 0:
        sys.stdout.write(out[-4000:])
        hit = sorted({m.id for m in mutants for f in failing for t in m.tests
                      if f == t or f.startswith(t.split("::")[0] + "::") and "::" not in t})
        die(f"the baseline fails on the UNMUTATED tree (pytest exit {rc}; failing: "
                 f"{failing or first_failure(out)}), so mutants {hit or 'selecting them'} would look "
                 "caught. Fix the tests (or the selections in tests/mutants/) first, or pass "
                 "--no-baseline to run anyway.")
    times: dict[str, float] = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        module = case.get("classname", "").split(".")
        path = "/".join(module[: next((i + 1 for i, x in enumerate(module) if x.startswith("test_")),
                                      len(module))]) + ".py"
        times[path] = times.get(path, 0.0) + float(case.get("time", 0))
    print(f"baseline ok in {secs:.0f} s: " + ", ".join(f"{p} {t:.0f} s" for p, t in times.items()),
          flush=True)
    return times


def timeout_for(m: Mutant, times: dict[str, float]) -> float:
    files = {t.split("::")[0] for t in m.tests}
    if not times or not files <= set(times):
        return DEFAULT_TIMEOUT_S
    return max(MIN_TIMEOUT_S, 4 * sum(times[f] for f in files))


def run_one(slot: Slot, m: Mutant, timeout: float, keep_going: bool = False) -> Result:
    slot.fresh_copy(m)
    rc, out, secs = slot.pytest(m.tests, timeout, stop_first=not keep_going)
    result, failing = classify(rc, out)
    if m.equivalent:
        result = "equivalent (missed)" if result == "missed" else "equivalent (caught)"
    failures = tuple(f.group(2) for f in map(_SUMMARY.match, out.splitlines()) if f)
    if len(failures) > 1:
        failing += f" (+{len(failures) - 1} more)"
    return Result(m, result, failing, secs, out[-3000:] if result.startswith(("error", "equivalent (c")) else "",
                  failures)


def select(args) -> list[Mutant]:
    ids = {m.id for m in MUTANTS}
    dupes = sorted({m.id for m in MUTANTS if [x.id for x in MUTANTS].count(m.id) > 1})
    if dupes:
        die(f"duplicate mutant ids in tests/mutants/: {dupes}")
    chosen = list(MUTANTS)
    if args.only:
        want = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [w for w in want if w not in ids]
        if unknown:
            die(f"--only: unknown mutant id(s) {unknown}; see --list for the ids.")
        chosen = [m for m in chosen if m.id in want]
    if args.category:
        cats = sorted({m.category for m in MUTANTS})
        if args.category not in cats:
            die(f"--category={args.category!r} is not one of {cats}.")
        chosen = [m for m in chosen if m.category == args.category]
    if not chosen:
        die("--only and --category together select no mutant.")
    return chosen


# ----------------------------------------------------------------------------- report


def markdown(results: list[Result], title: str = "") -> str:
    out = [title] if title else []
    out += ["| id | category | result | first failing test | s |", "|---|---|---|---|---|"]
    for r in results:
        fail = r.first_failure.replace("|", "\\|") or ("-" if r.result != "stale" else r.detail)
        out.append(f"| {r.mutant.id} | {r.mutant.category} | {r.result} | {fail} | {r.seconds:.0f} |")
    out += ["", summary(results)]
    return "\n".join(out)


def summary(results: list[Result]) -> str:
    cats = list(dict.fromkeys(r.mutant.category for r in results))
    cols = ("caught", "missed", "equivalent", "stale", "other")

    def bucket(r: Result) -> str:
        if r.result in CAUGHT:
            return "caught"
        if r.result.startswith("equivalent"):
            return "equivalent"
        return r.result if r.result in cols else "other"

    lines = ["| category | " + " | ".join(cols) + " | total |", "|---" * (len(cols) + 2) + "|"]
    for cat in cats + ["**total**"]:
        rs = [r for r in results if cat == "**total**" or r.mutant.category == cat]
        n = [sum(bucket(r) == c for r in rs) for c in cols]
        lines.append(f"| {cat} | " + " | ".join(map(str, n)) + f" | {len(rs)} |")
    return "\n".join(lines)


def failed(results: list[Result]) -> list[Result]:
    """What makes the exit status non-zero."""
    return [r for r in results if r.result in ("missed", "stale", "error", "equivalent (caught)")]


def write_reports(args, results: list[Result], seconds: float, note: str) -> None:
    """--markdown / --json, rewritten after every mutant so a killed run keeps its results."""
    if args.markdown:
        pathlib.Path(args.markdown).write_text(markdown(results) + f"\n\n{note}\n")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"seconds": round(seconds, 1), "note": note, "results": [r.row() for r in results]},
            indent=1) + "\n")


def list_mutants(mutants: list[Mutant], check: bool = False) -> int:
    """Print the mutants; with `check`, exit status 1 if one is stale (its code changed)."""
    stale, snap = 0, snapshot(tree_files())
    for m in mutants:
        why, where = stale_reason(m, snap), locate(m, snap)
        stale += bool(why)
        mark = ("STALE: " + why if why else f"moved: now in {where}" if where != m.file
                else "equivalent: " + m.equivalent if m.equivalent else "")
        print(f"{m.id:32s} {m.category:10s} {m.file}: {m.description}"
              f"\n{'':43s}tests: {' '.join(m.tests)}" + (f"\n{'':43s}{mark}" if mark else ""))
    print(f"{len(mutants)} mutants, {stale} stale")
    return 1 if check and stale else 0


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated mutant ids")
    ap.add_argument("--category", help="run one category (see --list)")
    ap.add_argument("--list", action="store_true", help="list the mutants and say which no longer apply")
    ap.add_argument("--check", action="store_true",
                    help="like --list, but exit 1 if a mutant is stale (its snippet changed, not just moved)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--markdown", metavar="PATH", help="also write the markdown table")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run in parallel (default 1)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated sanity pass")
    ap.add_argument("--keep-going", action="store_true",
                    help="run each selection to the end (no -x) and report every failing test: "
                         "which tests catch a mutant, not only the first")
    ap.add_argument("--run-equivalent", action="store_true", help="run mutants labelled equivalent too")
    ap.add_argument("--timeout", type=float, default=None,
                    help=f"seconds per mutant (default: 4x its selection's baseline, >= {MIN_TIMEOUT_S})")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs={args.jobs} must be >= 1")
    if args.timeout is not None and args.timeout <= 0:
        ap.error(f"--timeout={args.timeout} must be positive")
    mutants = select(args)
    if args.list or args.check:
        return list_mutants(mutants, check=args.check)
    for path in (args.json, args.markdown):
        if path and not pathlib.Path(path).resolve().parent.is_dir():
            ap.error(f"the directory of {path!r} does not exist")

    snap = snapshot(tree_files())
    t_start = time.perf_counter()
    results: dict[str, Result] = {}
    runnable = []
    for m in mutants:
        why = stale_reason(m, snap)
        if why:
            results[m.id] = Result(m, "stale", detail=why)
        elif m.equivalent and not args.run_equivalent:
            results[m.id] = Result(m, "equivalent", detail=m.equivalent)
        else:
            runnable.append(m)
    slots = [Slot(i, snap) for i in range(min(args.jobs, max(len(runnable), 1)))]
    pool = None
    try:
        times = {} if args.no_baseline or not runnable else baseline(slots[0], runnable)
        if runnable and args.no_baseline:
            slots[0].fresh_copy(None)
            slots[0].check_imports_resolve_here()
        free = list(slots)
        free_lock = threading.Lock()

        def work(m: Mutant) -> Result:
            with free_lock:
                slot = free.pop()
            try:
                return run_one(slot, m, args.timeout or timeout_for(m, times), args.keep_going)
            finally:
                with free_lock:
                    free.append(slot)

        pool = concurrent.futures.ThreadPoolExecutor(len(slots))
        futures = [pool.submit(work, m) for m in runnable]
        for k, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            r = fut.result()
            results[r.mutant.id] = r
            write_reports(args, [results[m.id] for m in mutants if m.id in results],
                          time.perf_counter() - t_start, f"partial: {k} of {len(runnable)} run so far")
            print(f"[{k}/{len(runnable)}] {r.mutant.id}: {r.result}"
                  + (f" ({r.first_failure})" if r.first_failure else "") + f" {r.seconds:.0f} s", flush=True)
    except KeyboardInterrupt:
        _STOP.set()  # no new pytest starts; queued mutants are dropped, running ones killed
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        with _RUNNING_LOCK:
            for proc in list(_RUNNING):
                _kill(proc)
        print("\nmutate: interrupted; partial results below.", file=sys.stderr)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        for s in slots:
            s.close()
    ordered = [results[m.id] for m in mutants if m.id in results]
    total_s = time.perf_counter() - t_start
    changed = changed_files(snap)
    text = markdown(ordered) + f"\n\n{len(ordered)} mutants in {total_s / 60:.1f} min; " + (
        f"the working tree was edited during the run ({', '.join(changed[:5])}): not by this tool, "
        "which never writes it; the results are for the tree as it was at the start."
        if changed else f"working tree unchanged ({len(snap)} files verified).")
    print("\n" + text)
    write_reports(args, ordered, total_s, text.rsplit("\n", 1)[-1])
    bad = failed(ordered)
    for r in bad:
        print(f"{r.result}: {r.mutant.id}: {r.mutant.description}"
              + (f" [{r.detail.splitlines()[0] if r.detail else ''}]" if r.result != "missed" else ""),
              file=sys.stderr)
    return 1 if bad or len(ordered) < len(mutants) else 0


if __name__ == "__main__":
    sys.exit(main())
