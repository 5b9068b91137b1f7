"""Sandbox harness: copied into the sandbox and run by the launcher as ``python -I -S -B harness MODE``.

Never imported by rljax. Before any model code runs it installs an audit hook (PEP 578) that
refuses sockets, process creation, signals, ctypes, frame and gc introspection, and writes outside
the work dir: a second wall behind the namespaces, limits and unprivileged user the launcher set up.

MODE "asserts": stdin holds one JSON line ``{"nonce", "code", "tests"}``; the code runs once, then
each test; a passing test prints ``<nonce> <index> pass`` (the nonce, unknown to the code, keeps a
``sys.exit(0)`` or a forged print from passing). MODE "io": runs ``solution.py`` as ``__main__``
with the case input on stdin; the parent compares stdout.
"""

import json
import os
import sys

ROOT = os.path.realpath(os.getcwd())
BLOCKED_PREFIXES = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn",
                    "os.fork", "os.forkpty", "os.system", "os.kill", "os.killpg", "os.setuid",
                    "signal.pthread_kill", "sys._getframe", "sys._current_frames", "gc.get_",
                    "sys.setprofile", "sys.settrace", "sys.addaudithook", "pty.", "mmap.")
BLOCKED_MODULES = ("_posixsubprocess", "_ctypes", "ctypes", "_socket", "socket", "_multiprocessing",
                   "multiprocessing", "subprocess", "resource", "signal", "_signal", "pty", "fcntl")
PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link",
               "os.chmod", "os.chown", "os.truncate", "os.utime", "shutil.rmtree")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _inside(path):
    if isinstance(path, int):
        return True
    if isinstance(path, bytes):
        path = path.decode(errors="replace")
    full = os.path.realpath(os.path.join(ROOT, os.fspath(path)))
    return full == ROOT or full.startswith(ROOT + os.sep)


def _hook(event, args):
    if event.startswith(BLOCKED_PREFIXES):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0].split(".")[0] in BLOCKED_MODULES:
        raise PermissionError(f"sandbox: import {args[0]} is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else (
            isinstance(flags, int) and flags & WRITE_FLAGS)
        if writes and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} is not allowed")
    if event in PATH_EVENTS:
        paths = [a for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
        if not all(_inside(p) for p in paths):
            raise PermissionError(f"sandbox: {event} outside the work dir is not allowed")


def main():
    mode = sys.argv[1]
    if mode == "asserts":
        payload = json.loads(sys.stdin.readline())
        nonce, code, tests = payload["nonce"], payload["code"], payload["tests"]
        del payload
        write, out = os.write, os.dup(1)
        compiled = [compile(t, f"<test {i}>", "exec") for i, t in enumerate(tests)]
        solution = compile(code, "solution.py", "exec")
        del code, tests
        scope = {"__name__": "__main__"}
        sys.addaudithook(_hook)
        try:
            exec(solution, scope)
        except BaseException:  # noqa: BLE001  # a crashing solution fails every test
            os._exit(0)
        for i, test in enumerate(compiled):
            try:
                exec(test, scope)
            except BaseException:  # noqa: BLE001
                continue
            write(out, f"{nonce} {i} pass\n".encode())
        os._exit(0)
    with open("solution.py", encoding="utf-8") as f:
        solution = compile(f.read(), "solution.py", "exec")
    sys.addaudithook(_hook)
    try:
        exec(solution, {"__name__": "__main__"})
    except SystemExit as e:
        sys.stdout.flush()
        os._exit(0 if e.code in (None, 0) else 1)
    except BaseException:  # noqa: BLE001
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


main()
