"""Running a program a model wrote (the opt-in HumanEval gate), away from the host as far as a plain
Linux process can be, without root or containers:

- its own network namespace (no interface but a loopback that is down: no connection anywhere, the
  host's localhost included), mount namespace and PID namespace (it sees and signals only its own
  processes; when it ends, every process it started is killed with it);
- every mount read-only except a throw-away working directory, removed afterwards;
- limits: address space (`memory_mb`), CPU seconds, the size of any file it writes, no core dumps, and
  a wall-clock timeout after which the whole namespace is killed;
- `python -I` (no user site, no PYTHONPATH, no current directory on sys.path) and an environment of
  PATH, HOME and TMPDIR only; stdin closed, stdout discarded.

What it does NOT protect against (say so wherever the opt-in is offered): the program can *read*
every file the user running qdflash can read (your home, the repository, /etc); it can use all CPU
cores and fork until the timeout (there is no process-count limit, and the memory limit is per
process); it can call libc and any system call the kernel allows an unprivileged user namespace;
it runs with the uid of the user running qdflash as the kernel sees it, so a kernel bug or a
misconfigured system can be an escape. It is not a security boundary for hostile code: run the
HumanEval gate only on a machine you would let the model's author log into.

Needs `unshare` (util-linux) and user namespaces (root, or a kernel that allows them unprivileged);
where they are missing the gate is refused with the reason, never run unconfined.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import QdflashError

UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child",
           "--mount-proc", "--propagation", "private"]

# Runs first inside the namespaces (trusted code): makes every mount read-only but the working
# directory, sets the limits, then becomes the untrusted program (argv: workdir, bytes of address
# space, CPU seconds, bytes per file).
_LAUNCHER = r"""
import os, re, resource, subprocess, sys
workdir, memory, cpu, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def mount(*args):
    return subprocess.run(["mount", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
done = mount("--bind", workdir, workdir)
if done.returncode:
    sys.exit(f"sandbox: cannot bind-mount {workdir}: {done.stderr.strip()}")
with open("/proc/self/mountinfo") as handle:
    points = [re.sub(r"\\(\d{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in handle]
for point in points:
    if point == workdir or point == "/proc" or point.startswith(("/proc/", "/sys")):
        continue  # proc and sysfs: the kernel's views, not files the program could change
    done = mount("-o", "remount,bind,ro", point)
    if done.returncode:
        sys.exit(f"sandbox: cannot make {point} read-only: {done.stderr.strip()}")
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                     (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
os.chdir(workdir)
os.execve(sys.executable, [sys.executable, "-I", "program.py"],
          {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1"})
"""


@dataclass
class Outcome:
    passed: bool
    result: str  # "passed", "timed out after N s", or "failed (exit code N): <the end of its stderr>"


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Why programs cannot be sandboxed on this machine (None when they can): tried once."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "`unshare` and `mount` (util-linux) are not installed"
    with tempfile.TemporaryDirectory(prefix="qdflash-sandbox-probe-") as workdir:
        (Path(workdir) / "program.py").write_text("pass\n")
        try:
            done = subprocess.run(_command(workdir, 256, 30, 1 << 20), stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"the sandbox could not start ({type(err).__name__}: {err})"
    if done.returncode:
        return f"the sandbox could not start (`unshare` needs user namespaces): {done.stderr.strip()[-500:]}"
    return None


def _command(workdir: str, memory_mb: int, cpu_s: int, file_bytes: int) -> list[str]:
    return [*UNSHARE, sys.executable, "-I", "-c", _LAUNCHER, workdir, str(memory_mb << 20), str(cpu_s), str(file_bytes)]


def require_sandbox() -> None:
    reason = unavailable()
    if reason:
        raise QdflashError(f"running model-written code needs the sandbox of qdflash.evaluation.sandbox, and {reason}. "
                           "It is never run unconfined; run the HumanEval gate where `unshare --user --net` works.")


def run_untrusted(program: str, *, timeout: float, memory_mb: int = 1024, file_mb: int = 16) -> Outcome:
    """Run `program` (Python source) in the sandbox; it passes when it exits with code 0 in time."""
    require_sandbox()
    with tempfile.TemporaryDirectory(prefix="qdflash-untrusted-") as workdir, tempfile.TemporaryFile() as stderr:
        (Path(workdir) / "program.py").write_text(program)
        cpu = math.ceil(timeout) + 1  # CPU seconds: a backstop; the wall clock below decides
        proc = subprocess.Popen(_command(workdir, memory_mb, cpu, file_mb << 20), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _end_namespace(proc)
            return Outcome(False, f"timed out after {timeout:g} s")
        if code == 0:
            return Outcome(True, "passed")
        stderr.seek(0)
        tail = stderr.read()[-1000:].decode("utf-8", "replace").strip()
        return Outcome(False, f"failed (exit code {code}): {tail}")


def _end_namespace(proc: subprocess.Popen) -> None:
    """Kill the program's PID namespace and return once none of its processes is left.

    The namespace's init is unshare's child (the program itself). When an init dies, the kernel kills
    every other process of its namespace, and the init's own exit completes only once they are all
    gone; unshare waits for that exit. So: kill the init, then wait for unshare. Killing unshare
    instead (--kill-child then kills the init) returns at once while the namespace is still dying: on a
    loaded machine a process the program had forked was still running after that wait."""
    children = _children(proc.pid)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if not children:  # not forked yet, or gone already: the whole group, as a last resort
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _children(pid: int) -> list[int]:
    """The live children of `pid` (Linux /proc; [] where it cannot tell)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4, after the parenthesized name
                found.append(int(entry.name))
    return found
