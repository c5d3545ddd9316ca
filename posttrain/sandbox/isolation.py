"""How a sandboxed process is started: the bubblewrap command line, or the rlimit-only fallback.

Under bubblewrap the candidate sees only read-only system directories, a private size-capped /tmp, its
own files at /sandbox (read-only), a private /proc and /dev; it has no network (all namespaces are
unshared), no capabilities, no environment from the host, and dies with its parent. When the host runs
as root, bubblewrap is started as `nobody` so that the sandbox's user maps to an unprivileged host user:
the kernel skips RLIMIT_NPROC for processes that map to root, which would let a fork bomb through.

The switch to `nobody` is made by util-linux's `setpriv`, which then execs bubblewrap, rather than by
`subprocess.Popen(user=, group=, extra_groups=)`: CPython starts a child with vfork only when it changes no
ids, and otherwise forks, copying the page tables of the whole parent: from a process holding a model, as
a code-RL run embedding localtinker does, that made each sandboxed run several times slower
(bench/bench_sandbox.py, part 3; docs/benchmarks.md). Without `setpriv` on PATH, Popen
switches the ids itself (``Launch.run_as_nobody``).
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from posttrain.sandbox.limits import ALLOW_UNSANDBOXED_ENV, Limits, rlimit_only_allowed

SANDBOX_DIR = "/sandbox"
PYTHON_ENV = "POSTTRAIN_SANDBOX_PYTHON"
BWRAP_ENV = "POSTTRAIN_SANDBOX_BWRAP"
"""The bubblewrap executable (default `bwrap` on PATH); pointing it at a missing path simulates a host
without bubblewrap."""
NOBODY = 65534
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp", "PYTHONHASHSEED": "0"}
BWRAP = "bwrap"
RLIMIT_ONLY = "rlimit_only"


class SandboxUnavailableError(RuntimeError):
    """bubblewrap is missing and the caller did not opt in to the rlimit-only mode."""


@dataclass(frozen=True)
class Launch:
    """Everything needed to start one run: argv, where the program lives as the sandbox sees it, and
    the host-side process options."""

    argv: list[str]
    program_path: str
    cwd: str | None
    run_as_nobody: bool  # Popen switches to nobody itself (root host without setpriv)
    isolation: str


def sandbox_python() -> str:
    """The interpreter that runs candidates: $POSTTRAIN_SANDBOX_PYTHON, else the system python3 (it lives
    under /usr, which the sandbox mounts), else the real path of the current interpreter."""
    configured = os.environ.get(PYTHON_ENV)
    if configured:
        return configured
    if Path("/usr/bin/python3").exists():
        return "/usr/bin/python3"
    return str(Path(sys.executable).resolve())


def bwrap_executable() -> str | None:
    return shutil.which(os.environ.get(BWRAP_ENV, "bwrap"))


def choose_isolation(allow_rlimit_only: bool | None) -> str:
    if bwrap_executable():
        return BWRAP
    if rlimit_only_allowed(allow_rlimit_only):
        return RLIMIT_ONLY
    raise SandboxUnavailableError(
        "bubblewrap (`bwrap`) is not installed, so candidate code cannot be isolated. Install it "
        "(Debian/Ubuntu: apt-get install bubblewrap), or accept running untrusted code with resource limits "
        f"only by passing allow_rlimit_only=True or setting {ALLOW_UNSANDBOXED_ENV}=1."
    )


def launch_for(isolation: str, host_dir: Path, spec_fd: int, limits: Limits, harness_name: str) -> Launch:
    """How to start the interpreter on ``host_dir/harness_name`` (already written there)."""
    python = sandbox_python()
    if isolation == BWRAP:
        argv = _bwrap_argv(host_dir, limits) + [python, "-I", "-S", "-B", f"{SANDBOX_DIR}/{harness_name}", str(spec_fd)]
        as_root = os.geteuid() == 0
        setpriv = shutil.which("setpriv") if as_root else None
        if setpriv:
            argv = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--", *argv]
        return Launch(argv, f"{SANDBOX_DIR}/program.py", None, as_root and not setpriv, BWRAP)
    warnings.warn(
        "running untrusted code WITHOUT a sandbox (rlimit-only mode): it can read your files, use the "
        "network and leave processes behind. Install bubblewrap to isolate it.",
        RuntimeWarning,
        stacklevel=4,
    )
    work = host_dir / "work"
    work.mkdir(exist_ok=True)
    argv = [python, "-I", "-S", "-B", str(host_dir / harness_name), str(spec_fd)]
    return Launch(argv, str(host_dir / "program.py"), str(work), False, RLIMIT_ONLY)


def _bwrap_argv(host_dir: Path, limits: Limits) -> list[str]:
    argv = [bwrap_executable() or "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    for directory in SYSTEM_DIRS:
        path = Path(directory)
        if path.is_symlink():
            argv += ["--symlink", os.readlink(path), directory]
        elif path.is_dir():
            argv += ["--ro-bind", directory, directory]
    python_prefix = Path(sandbox_python()).resolve().parent.parent
    if not any(str(python_prefix).startswith(d + "/") or str(python_prefix) == d for d in SYSTEM_DIRS):
        argv += ["--ro-bind", str(python_prefix), str(python_prefix)]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--size", str(limits.tmp_size_mb * 1024 * 1024), "--tmpfs", "/tmp"]
    argv += ["--ro-bind", str(host_dir), SANDBOX_DIR, "--chdir", "/tmp", "--clearenv"]
    for name, value in CLEAN_ENV.items():
        argv += ["--setenv", name, value]
    return argv + ["--"]
