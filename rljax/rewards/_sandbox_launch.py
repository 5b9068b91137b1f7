"""Sandbox launcher: runs as its own process (``python -I -S -B this_file CONFIG_JSON``), never imported.

Steps (each where the kernel permits, and recorded on the first stderr line):
1. unshare network, PID and mount namespaces: no network device but a downed loopback; the sandbox
   is PID 1 of its own namespace, so when it dies every process it forked dies with it;
2. bind the Python install read-only under the sandbox root, so an unprivileged user can run it;
3. fork (entering the PID namespace), set resource limits, drop to user ``nobody`` (when root),
   then exec the child harness in the sandbox's work dir with a scrubbed environment.
The launcher itself waits and exits with the child's status (128 + signal when killed).
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x40000000, 0x20000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
NOBODY = 65534


def main() -> None:
    cfg = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    isolation = []
    if libc.unshare(CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS) == 0:
        isolation = ["net", "pid", "mnt"]
    elif libc.unshare(CLONE_NEWNET) == 0:
        isolation = ["net"]
    python = sys.executable
    if "mnt" in isolation:
        mnt = os.path.join(cfg["root"], "python")
        ok = libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0
        ok = ok and libc.mount(sys.base_prefix.encode(), mnt.encode(), None, MS_BIND | MS_REC,
                               None) == 0
        ok = ok and libc.mount(None, mnt.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY,
                               None) == 0
        if ok:
            rel = os.path.relpath(os.path.realpath(sys.executable), sys.base_prefix)
            python = os.path.join(mnt, rel)
            isolation.append("python-ro")
    drop = os.getuid() == 0 and "python-ro" in isolation
    if drop:
        isolation.append("nobody")
    sys.stderr.write("rljax-sandbox: " + ",".join(isolation) + "\n")
    sys.stderr.flush()
    pid = os.fork() if "pid" in isolation else 0
    if pid:
        os.closerange(0, 3)  # the child owns the pipes; EOF arrives when it (and its forks) exit
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        code = os.waitstatus_to_exitcode(status)
        os._exit(128 - code if code < 0 else code)
    limits = cfg["limits"]
    for res, value in ((resource.RLIMIT_CPU, limits["cpu_s"]), (resource.RLIMIT_AS, limits["as_bytes"]),
                       (resource.RLIMIT_FSIZE, limits["file_bytes"]),
                       (resource.RLIMIT_NPROC, limits["nproc"]), (resource.RLIMIT_NOFILE, 64),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))
    os.chdir(cfg["work"])
    if drop:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    env = {"PATH": "/usr/bin:/bin", "HOME": cfg["work"], "TMPDIR": cfg["work"], "LANG": "C.UTF-8"}
    os.execve(python, [python, "-I", "-S", "-B", cfg["harness"], cfg["mode"]], env)


main()
