"""rewards.run_code: correct scoring, and every attack scores 0 within its limit, leaving us unharmed."""

import os
import re
import socket
import subprocess
import sys
import time
import uuid

import pytest

from rljax.errors import DataError
from rljax.rewards import CodeTests, SandboxLimits, extract_code, run_code

LIMITS = SandboxLimits(cpu_s=1, wall_s=3.0, memory_mb=256, output_bytes=1 << 16, total_s=8.0)
SECRET = "rljax-fake-secret-" + uuid.uuid4().hex


def _run(code, tests):
    t0 = time.monotonic()
    score, info = run_code(code, tests, LIMITS)
    return score, info, time.monotonic() - t0


def test_scores_fraction_of_asserts_and_io_cases():
    """Score = fraction passed, for assert tests and for stdin/stdout cases."""
    score, info, _ = _run("def f(x):\n    return 2 * x", ["assert f(2) == 4", "assert f(3) == 7",
                                                         "assert f(0) == 0"])
    assert score == pytest.approx(2 / 3) and info["results"] == [True, False, True]
    score, info, _ = _run("a, b = map(int, input().split())\nprint(a + b)",
                          [{"input": "1 2\n", "output": "3"}, {"input": "5 5\n", "output": "11"},
                           {"input": "0 0", "output": "0\n"}])
    assert score == pytest.approx(2 / 3) and info["results"] == [True, False, True]


def test_exit_and_forged_output_do_not_pass():
    """sys.exit(0) before the tests, or printing a fake pass line, passes nothing."""
    assert _run("import sys\nsys.exit(0)", ["assert False"])[0] == 0.0
    assert _run("print('x 0 pass')", ["assert False"])[0] == 0.0
    assert _run("import os\nos._exit(0)", [{"input": "", "output": "1"}])[0] == 0.0


ATTACKS = {
    "infinite_loop": "while True:\n    pass",
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "fork_bomb_posix_spawn": "import os\nwhile True:\n    os.posix_spawn('/bin/sh', ['sh'], {})",
    "memory_hog": "x = bytearray(8 * 1024 ** 3)\nblocks = [bytearray(10**8) for _ in range(100)]",
    "stdout_flood": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
    "ctypes_escape": "import ctypes\nctypes.CDLL(None).fork()",
}


# How each attack must be stopped: the flag `run_code` reports. An empty tuple means the program
# died on its own at once (the audit hook refused the call, or RLIMIT_AS refused the allocation).
STOPPED_BY = {
    "infinite_loop": ("killed:signal 9", "killed:signal 24", "timeout"),  # RLIMIT_CPU or the wall
    "fork_bomb": (),
    "fork_bomb_posix_spawn": (),
    "memory_hog": (),
    "stdout_flood": ("output_limit",),
    "ctypes_escape": (),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attacks_score_zero_within_limit(name):
    """Each hostile program scores 0 within its wall limit, stopped by the wall meant for it, and
    leaves this process unharmed: no process of it survives the call, and our own memory peak
    stays flat.

    Catches: a sandbox that no longer caps stdout (the flood runs to the wall clock and the parent
    buffers it: no "output_limit" flag, and our memory peak jumps), one that lets fork/posix_spawn/
    ctypes through (the bomb runs until the wall: a "timeout" flag instead of none), one without
    RLIMIT_AS (the hog allocates and `assert True` passes), one that neither limits CPU nor kills
    the process group at the wall (the loop outlives the call), and one that runs the code in this
    process (our memory peak jumps)."""
    already = set(_descendants(os.getpid()))  # e.g. verifier pools other tests in this worker started
    rss0 = _reset_peak_rss()
    score, info, took = _run(ATTACKS[name], ["assert True"])
    assert score == 0.0 and info["results"] == [False]
    assert took < LIMITS.wall_s + 3.0
    flags = tuple(info["flags"])
    if STOPPED_BY[name]:
        assert len(flags) == 1 and flags[0] in STOPPED_BY[name], flags
    else:
        assert flags == (), flags
    assert _vm_kib("VmHWM") - rss0 < 64 << 10, "the attack's output or memory reached this process"
    deadline = time.monotonic() + 5.0  # SIGKILLed processes take a moment to be reaped
    while set(_descendants(os.getpid())) - already and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(_descendants(os.getpid())) - already


def _vm_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))


def _reset_peak_rss() -> int:
    """Resets this process's peak RSS (VmHWM) to its current RSS and returns that, in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _vm_kib("VmRSS")


def _descendants(root: int) -> list[int]:
    """Live (non-zombie) processes whose parent chain reaches `root`."""
    parent, state = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state[int(pid)], parent[int(pid)] = fields[0], int(fields[1])
    found = []
    for pid in parent:
        p = pid
        while p in parent and p != root and p > 1:
            p = parent[p]
        if p == root and pid != root and state[pid] != "Z":
            found.append(pid)
    return found


def test_fork_bomb_leaves_no_processes_behind():
    """After a fork bomb, no process of the sandbox user remains (its PID namespace died with it)."""
    _run("import os\nwhile True:\n    os.fork()", ["assert True"])
    _run("import os\nfor _ in range(20):\n    if os.fork() == 0:\n        import time\n"
         "        time.sleep(100)", ["assert True"])
    deadline = time.monotonic() + 5.0  # SIGKILLed processes take a moment to be reaped
    while _sandbox_user_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _sandbox_user_processes()


def _sandbox_user_processes():
    owners = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        if "\nUid:\t65534\t" in status and "\nState:\tZ" not in status:
            owners.append(pid)
    return owners


def test_writes_outside_temp_dir_fail(tmp_path):
    """Writing to /tmp, to our files or via os.open outside its cwd fails; inside its cwd works."""
    targets = [f"/tmp/rljax-escape-{uuid.uuid4().hex}", str(tmp_path / "planted.txt")]
    code = "import os\n" + "".join(
        f"try:\n    open({t!r}, 'w').write('pwned')\nexcept Exception:\n    pass\n"
        f"try:\n    os.close(os.open({t!r}, os.O_CREAT | os.O_WRONLY))\nexcept Exception:\n    pass\n"
        for t in targets) + "open('inside.txt', 'w').write('ok')\n"
    tests = [f"import os\nassert os.path.exists({t!r})" for t in targets]
    tests.append("assert open('inside.txt').read() == 'ok'")
    score, info, _ = _run(code, tests)
    assert info["results"] == [False, False, True]
    assert not any(os.path.exists(t) for t in targets)


def test_parent_environment_secret_does_not_leak(monkeypatch):
    """A secret planted in our environment is not in the child's env, nor in /proc/<ppid>/environ."""
    monkeypatch.setenv("RLJAX_FAKE_SECRET", SECRET)
    code = ("import os\nfound = ''.join(os.environ.values())\n"
            f"for pid in [os.getppid(), {os.getpid()}]:\n"
            "    try:\n        found += open(f'/proc/{pid}/environ', 'rb').read().decode()\n"
            "    except Exception:\n        pass\n"
            "print(found)")
    score, info, _ = _run(code, [{"input": "", "output": SECRET}])
    assert score == 0.0
    score, _, _ = _run(code.replace("print(found)", "SECRET = found"),
                       [f"assert {SECRET!r} in SECRET"])
    assert score == 0.0


def test_network_is_unreachable():
    """A socket to a server listening in this process cannot be opened from the sandbox, and the
    sandbox does not even see that server: it runs in a network namespace of its own.

    Catches: a launcher that stops unsharing the network namespace (the listener shows up in the
    sandbox's /proc/net/tcp, which the audit hook does not guard), and a sandbox that lets a
    connection through (the server accepts one, and `assert True` passes)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.1)
    port = server.getsockname()[1]
    try:
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                "s.sendall(b'hi')")
        score, info, _ = _run(code, ["assert True"])
        with pytest.raises(OSError):
            server.accept()  # nobody connected
        assert score == 0.0

        # The listener as /proc/net/tcp shows it (local address 0100007F:PORT in hex, state 0A).
        listener = f"0100007F:{port:04X} 00000000:0000 0A"
        assert listener in _proc_net_tcp(), "the probe must see the listener from our namespace"
        if not _kernel_grants_network_namespace():
            pytest.skip("this kernel refuses network namespaces; only the audit-hook wall is tested")
        score, info, _ = _run("t = open('/proc/net/tcp').read()", [f"assert {listener!r} not in t"])
        assert score == 1.0, "the sandbox shares this process's network namespace"
        assert "net" in info["isolation"]
    finally:
        server.close()


def _proc_net_tcp() -> str:
    with open("/proc/net/tcp") as f:
        return f.read()


def _kernel_grants_network_namespace() -> bool:
    """Asks the kernel directly, in a throwaway process, whether unshare(CLONE_NEWNET) works here."""
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare(0x40000000) != 0)"
    return subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


def test_signalling_parent_fails():
    """Killing our pid, the launcher's pid or the process group from the sandbox fails; we survive."""
    me = os.getpid()
    for code in [f"import os, signal\nos.kill({me}, signal.SIGKILL)",
                 "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
                 "import os, signal\nos.killpg(0, signal.SIGKILL)",
                 f"import signal\nsignal.pthread_kill({me}, 9)"]:
        score, _, _ = _run(code, ["assert True"])
        assert score == 0.0  # and this test process is still here to check it


def test_rejects_malformed_tests():
    """Empty or mixed test lists raise DataError."""
    with pytest.raises(DataError):
        run_code("pass", [])
    with pytest.raises(DataError):
        run_code("pass", ["assert True", {"input": ""}])


def test_code_tests_verifier_uses_last_fenced_block():
    """CodeTests runs the completion's last ```python block against metadata['tests']."""
    completion = "Try:\n```python\ndef f(): return 0\n```\nFixed:\n```python\ndef f(): return 1\n```"
    assert extract_code(completion).strip() == "def f(): return 1"
    score, info = CodeTests(limits=LIMITS)({"tests": ["assert f() == 1"]}, completion)
    assert score == 1.0 and info["passed"] == 1
