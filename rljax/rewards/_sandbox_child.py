"""Sandbox harness: copied into the sandbox and run by the launcher as ``python -I -S -B harness MODE``.

Never imported by rljax. Before any model code runs it installs an audit hook (PEP 578) that
refuses sockets, process creation, signals, ctypes, frame and gc introspection, writes outside
the work dir, and reads outside the work dir and the Python install (the task's data files, with
their expected outputs, are on the same disk): a second wall behind the namespaces, limits and
unprivileged user the launcher set up.

The code cannot tamper with the harness: every builtin the harness calls after the code has run
(``exec``, ``type``...) is bound before it runs, and each assert's ``==`` / ``!=`` is rewritten to
`_plain_compare`, which compares only plain values (built-in types, all the way down), so an object
whose class says it equals everything (``__eq__`` returning True) passes no test.

MODE "asserts": stdin holds one JSON line ``{"nonce", "code", "tests"}``; the code runs once, then
each test; a passing test prints ``<nonce> <index> pass`` (the nonce, unknown to the code, keeps a
``sys.exit(0)`` or a forged print from passing). MODE "io": runs ``solution.py`` as ``__main__``
with the case input on stdin; the parent compares stdout.
"""

import ast
import json
import os
import sys

ROOT = os.path.realpath(os.getcwd())
# Reads allowed besides the work dir: the Python install (the standard library) and the kernel's
# views (/proc of the sandbox's own namespaces, /dev/urandom and the like).
READABLE = tuple({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
                                                "/proc", "/dev")})
PLAIN_SCALARS = (int, float, complex, bool, str, bytes, type(None))
PLAIN_CONTAINERS = (list, tuple, set, frozenset, dict)
BLOCKED_PREFIXES = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn",
                    "os.fork", "os.forkpty", "os.system", "os.kill", "os.killpg", "os.setuid",
                    "signal.pthread_kill", "sys._getframe", "sys._current_frames", "gc.get_",
                    "sys.setprofile", "sys.settrace", "sys.addaudithook", "pty.", "mmap.")
BLOCKED_MODULES = ("_posixsubprocess", "_ctypes", "ctypes", "_socket", "socket", "_multiprocessing",
                   "multiprocessing", "subprocess", "resource", "signal", "_signal", "pty", "fcntl")
PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link",
               "os.chmod", "os.chown", "os.truncate", "os.utime", "shutil.rmtree")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _inside(path, roots=(ROOT,)):
    if isinstance(path, int):
        return True
    if isinstance(path, bytes):
        path = path.decode(errors="replace")
    full = os.path.realpath(os.path.join(ROOT, os.fspath(path)))
    return any(full == root or full.startswith(root + os.sep) for root in roots)


def _plain(value, _type=type, _scalars=PLAIN_SCALARS, _containers=PLAIN_CONTAINERS, _all=all):
    """Whether ``value`` is built of built-in types only (no user class can override its ``==``)."""
    kind = _type(value)
    if kind in _scalars:
        return True
    if kind is dict:
        return _all(_plain(k) and _plain(v) for k, v in value.items())
    return kind in _containers and _all(_plain(v) for v in value)


def _plain_compare(left, right, equal):
    """``left == right`` (``equal``) or ``left != right`` for plain values; False when either side
    is not plain, so neither comparison can be won by a class that decides its own answer."""
    if not (_plain(left) and _plain(right)):
        return False
    return left == right if equal else left != right


class _StrictEquality(ast.NodeTransformer):
    """Rewrites ``a == b`` / ``a != b`` to ``_plain_compare(a, b, True / False)``."""

    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            return node
        equal = ast.Constant(isinstance(node.ops[0], ast.Eq))
        call = ast.Call(ast.Name("__rljax_plain_compare", ast.Load()), [node.left, node.comparators[0], equal], [])
        return ast.copy_location(call, node)


def _compile_test(text, i):
    tree = ast.fix_missing_locations(_StrictEquality().visit(ast.parse(text)))
    return compile(tree, f"<test {i}>", "exec")


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
        if not writes and not _inside(path, (ROOT, *READABLE)):
            raise PermissionError(f"sandbox: reading {path!r} is not allowed")
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
        write, out, run, leave, caught = os.write, os.dup(1), exec, os._exit, BaseException
        compiled = [_compile_test(t, i) for i, t in enumerate(tests)]
        solution = compile(code, "solution.py", "exec")
        del code, tests
        scope = {"__name__": "__main__"}
        sys.addaudithook(_hook)
        try:
            run(solution, scope)
        except caught:  # a crashing solution fails every test
            leave(0)
        for i, test in enumerate(compiled):
            scope["__rljax_plain_compare"] = _plain_compare  # set after the code ran: it cannot replace it
            try:
                run(test, scope)
            except caught:
                continue
            write(out, (nonce + " " + repr(i) + " pass\n").encode())
        leave(0)
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
