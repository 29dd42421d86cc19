"""Lab 1's example submissions: the honest mistakes (``partial``, a syntax error, an edited
test, a deleted cell, a cell that never ends) and the hostile corpus: one submission per kind of
attack on the machine (``attack_*``, graded only inside the sandbox) or on the grading
(``cheat_*``). Each is an honest submission with ONE hostile part, so that its expected grade says
both things at once: the hostile part gains nothing, and the honest parts keep their points."""

from __future__ import annotations

import copy
from typing import Any

from .common import (
    Edit,
    Wrong,
    _after_docstring,
    _answers,
    _append,
    _cell,
    _gid,
    _replace,
    blank,
    perfect,
    swap,
    wrong_examples,
)
from .hostile import JUDGED, attack_spinners, cheat_patch_stdlib, cheat_read_history, odd_source

# ---------------------------------------------------------------------------------------
# lab 1's examples
# ---------------------------------------------------------------------------------------
LEXICAL_RESTORE = '''
def restore_checkpoint(ckpt_dir, target, step=None, prefix="checkpoint_", *, partial=False, fs=None):
    """Task 1.4 — my own version: the newest checkpoint is the last name in sorted order."""
    fs = fs or DEFAULT_FS
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    if re.fullmatch(re.escape(prefix) + r"\\d+", os.path.basename(ckpt_dir)) and os.path.isdir(ckpt_dir):
        path = ckpt_dir
    elif step is not None:
        path = os.path.join(ckpt_dir, f"{prefix}{step}")
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(f"Matching checkpoint not found: {path}")
    else:
        names = sorted(n for n in os.listdir(ckpt_dir) if n.startswith(prefix)) if os.path.isdir(ckpt_dir) else []
        if not names:
            return target
        path = os.path.join(ckpt_dir, names[-1])
    return Checkpointer(fs).restore(path, {ITEM: target}, partial=partial)[ITEM]
'''.strip()


NP_GENERIC_FIRST = '''    if isinstance(x, np.generic):  # before Python scalars: np.float64 subclasses float
        x = np.asarray(x)
    elif x is None or isinstance(x, SCALAR_TYPES):
        return x'''


NP_GENERIC_LAST = '''    if x is None or isinstance(x, SCALAR_TYPES):
        return x
    if isinstance(x, np.generic):
        x = np.asarray(x)'''


LITTLE_ENDIAN = """    if data.dtype.byteorder == ">":  # data.bin is little-endian whatever the machine
        data = data.astype(data.dtype.newbyteorder("<"))
    buf = np.ascontiguousarray(data).reshape(-1).view(np.uint8)"""


NATIVE_ORDER = """    buf = data.reshape(-1).view(np.uint8)  # the raw bytes, as they are in memory"""


CRC_CHECK = '''    if verify and "crc32" in entry:
        got = zlib.crc32(raw)'''


NO_CRC_CHECK = '''    if False:  # checksums later
        got = zlib.crc32(raw)'''


def partial(release: Any, source: Any) -> Any:
    """Task 1.1 right; 1.2 misses np.float64 (a float subclass); 1.3 writes each array's
    bytes as they are in memory (the array's own byte order, and a strided view refused),
    not little-endian C order; 1.4 finds the newest checkpoint by sorting names;
    7 of 11 quiz answers right."""
    nb = perfect(release, source)
    _replace(nb, "task_1_2", NP_GENERIC_FIRST, NP_GENERIC_LAST)
    _replace(nb, "task_1_3", LITTLE_ENDIAN, NATIVE_ORDER)
    _cell(nb, "task_1_4").source = LEXICAL_RESTORE
    _answers(nb, Q2='"B"', Q7="100.0", Q9='"B"', Q10="{100, 400}")
    return nb


def syntax_error(release: Any, source: Any) -> Any:
    """Task 1.2's cell does not even parse (a colon is missing); the rest is right."""
    nb = perfect(release, source)
    _replace(nb, "task_1_2", "elif x is None or isinstance(x, SCALAR_TYPES):",
             "elif x is None or isinstance(x, SCALAR_TYPES)")
    return nb


def edited_test(release: Any, source: Any) -> Any:
    """Task 1.3 skips the checksum, and both of its test cells were replaced by ``pass``."""
    nb = perfect(release, source)
    _replace(nb, "task_1_3", CRC_CHECK, NO_CRC_CHECK)
    for gid in ("test_1_3_leaf", "test_1_3_minickpt"):
        _cell(nb, gid).source = "pass"
    return nb


def _wrong_unflatten(nb: Any) -> None:
    cell = _cell(nb, "task_1_1")
    head, _, _ = cell.source.rpartition("def unflatten_like")
    cell.source = head + ('def unflatten_like(target, values):\n'
                          '    """Task 1.1 (back) — mine: the target already has the right shape."""\n'
                          '    return target')


def deleted_cell(release: Any, source: Any) -> Any:
    """``unflatten_like`` returns the target unchanged, and both task 1.1 test cells and one
    quiz test cell were deleted."""
    nb = perfect(release, source)
    _wrong_unflatten(nb)
    gone = {"test_1_1_names", "test_1_1_minickpt", "test_quiz_q5"}
    nb.cells = [c for c in nb.cells if _gid(c) not in gone]
    return nb


def never_finishes(release: Any, source: Any) -> Any:
    """``restore_checkpoint`` loops forever; the grader must stop that cell and go on."""
    nb = perfect(release, source)
    _replace(nb, "task_1_4", "    fs = fs or DEFAULT_FS\n",
             "    while True:  # waiting for the checkpoint to appear\n        pass\n"
             "    fs = fs or DEFAULT_FS\n")
    return nb


FORK_BOMB = """
# A fork bomb: every child sleeps, holding its place, and never returns.
import os
import time


def _fork_bomb(most=2000):
    made = 0
    while made < most:
        try:
            pid = os.fork()
        except OSError:  # the limit on processes
            break
        if pid == 0:
            try:
                time.sleep(3600)
            finally:
                os._exit(0)
        made += 1
    return made


print("forked", _fork_bomb(), "children before the system said no")
"""


def attack_fork_bomb(release: Any, source: Any) -> Any:
    """Right answers; the cell of task 1.2 forks until the system refuses."""
    nb = perfect(release, source)
    _append(nb, "task_1_2", FORK_BOMB)
    return nb


MEMORY_HOG = """
# A memory hog: 256 MiB at a time (each page touched) until the system says no.
hog = []
try:
    while len(hog) < 64:  # 16 GiB at most
        hog.append(bytearray(256 << 20))
    print("nothing stopped me at", len(hog) * 256, "MiB")
except MemoryError:
    print("MemoryError after", len(hog) * 256, "MiB")
del hog
"""


def attack_memory_hog(release: Any, source: Any) -> Any:
    """Right answers; the cell of task 1.3 allocates memory until it is refused."""
    nb = perfect(release, source)
    _append(nb, "task_1_3", MEMORY_HOG)
    return nb


HUGE_OUTPUT = """
# 1 GiB of output, 1 KiB per line.
line = "x" * 1023
for _ in range(1 << 20):
    print(line)
"""


def attack_huge_output(release: Any, source: Any) -> Any:
    """Right answers; the cell of task 1.1 prints 1 GiB."""
    nb = perfect(release, source)
    _append(nb, "task_1_1", HUGE_OUTPUT)
    return nb


READ_SOLUTIONS = r'''
# Look for the lab's source (or anyone's graded notebook) and take the quiz answers from it.
import ast
import os
import re

_found, _seen = {}, 0
_repo = os.path.dirname(os.path.dirname(os.path.abspath(mc.__file__)))
_places = [os.path.join(_repo, "solutions"), os.path.join(_repo, ".grading"), _repo,
           os.getcwd(), os.path.dirname(os.getcwd()), os.path.expanduser("~"), "/tmp", "/work",
           "/home", "/root", "/srv", "/opt", "/var", "/mnt"]
for _top in _places:
    for _dir, _subdirs, _files in os.walk(_top):
        _seen += len(_files)
        if _seen > 50_000:
            break
        for _name in _files:
            if not _name.endswith((".ipynb", ".db", ".json")):
                continue
            try:
                with open(os.path.join(_dir, _name), errors="ignore") as _f:
                    _text = _f.read(5_000_000).replace('\\"', '"')
            except OSError:
                continue
            for _q, _answer in re.findall(r"same\((?:set\()?(Q\d+)\)?, (.+?)\), ", _text):
                try:
                    _found.setdefault(_q, ast.literal_eval(_answer))
                except (ValueError, SyntaxError):
                    pass
print("answers found:", sorted(_found) or "none")
Q1 = _found.get("Q1")
'''


def attack_read_solutions(release: Any, source: Any) -> Any:
    """Right code; no quiz answer of its own: the answer cells search the disk for the lab's
    source or another graded notebook and copy the answers from it."""
    nb = perfect(release, source)
    _cell(nb, "quiz_q1").source = READ_SOLUTIONS.strip("\n")
    for k in range(2, 12):
        _cell(nb, f"quiz_q{k}").source = f'Q{k} = _found.get("Q{k}")'
    return nb


WRITE_OTHERS = """
# Try to leave a mark in every folder in reach, and to open other notebooks for writing.
import os

_repo = os.path.dirname(os.path.dirname(os.path.abspath(mc.__file__)))
_scratch = {"/tmp", "/dev/shm", os.path.abspath(os.getcwd())}
_marked, _writable, _seen = [], [], 0
for _top in [_repo, os.path.dirname(os.getcwd()), "/tmp", "/work", "/home", "/srv", "/var"]:
    for _dir, _subdirs, _files in os.walk(_top):
        _seen += 1
        if _seen > 5_000:
            break
        if os.path.abspath(_dir) in _scratch or (
                os.stat(_dir).st_uid == os.getuid() and "minickpt-grade" not in _dir):
            continue  # its own scratch space is allowed; the grader's socket folder is not
        try:
            with open(os.path.join(_dir, "PWNED-by-attack_write_others"), "x") as _f:
                _f.write("was here")
            _marked.append(_dir)
        except OSError:
            pass
        for _name in _files:
            if _name.endswith(".ipynb"):
                try:
                    open(os.path.join(_dir, _name), "ab").close()  # writable? (changes nothing)
                    _writable.append(os.path.join(_dir, _name))
                except OSError:
                    pass
print(f"marked {len(_marked)} folder(s); could write {len(_writable)} notebook(s)")
"""


def attack_write_others(release: Any, source: Any) -> Any:
    """Right answers; the cell of task 1.1 tries to write into every folder it can find
    (other students' included) and to open their notebooks for writing."""
    nb = perfect(release, source)
    _append(nb, "task_1_1", WRITE_OTHERS)
    return nb


NETWORK_PORTS = range(47900, 47920)


"""The ports attack_network tries (tests listen on one of them)."""


NETWORK = f"""
# Phone home: connect to every port a helper might listen on (localhost only), and send a note.
import socket

_reached = []
for _port in range({NETWORK_PORTS.start}, {NETWORK_PORTS.stop}):
    try:
        with socket.create_connection(("127.0.0.1", _port), timeout=0.5) as _s:
            _s.sendall(b"attack_network was here")
            _reached.append(_port)
    except OSError:
        pass
print("reached", _reached or "nothing")
"""


def attack_network(release: Any, source: Any) -> Any:
    """Right answers; the cell of task 1.1 connects to localhost ports 47900-47919."""
    nb = perfect(release, source)
    _append(nb, "task_1_1", NETWORK)
    return nb


def attack_ignore_interrupt(release: Any, source: Any) -> Any:
    """``restore_checkpoint`` ignores SIGINT and loops forever: 1.4 scores 0, the rest is
    kept (judged, the handler fails in the worker, which calls from a thread; graded by the
    kernel, the grader must stop the kernel itself and the quiz after it scores 0 too)."""
    nb = perfect(release, source)
    _after_docstring(nb, "task_1_4", "restore_checkpoint", """
import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)  # the time-out's interrupt changes nothing now
while True:
    pass
""")
    return nb


# -- cheating: every cheat_* has wrong code somewhere that the cheat tries to hide -----------
def _wrong_tasks_1_to_3(nb: Any) -> None:
    """1.1 returns the target, 1.2 misses np.float64, 1.3 skips the checksum."""
    _wrong_unflatten(nb)
    _replace(nb, "task_1_2", NP_GENERIC_FIRST, NP_GENERIC_LAST)
    _replace(nb, "task_1_3", CRC_CHECK, NO_CRC_CHECK)


NOOP_CHECKS = """
# My own, friendlier test helpers.
import contextlib


def check(ok, message):
    pass


def same(value, expected):
    return True


@contextlib.contextmanager
def expect_raises(exc_type, message):
    class Caught:
        value = exc_type("pretend")
    try:
        yield Caught()
    except BaseException:
        pass
"""


def cheat_redefine_check(release: Any, source: Any) -> Any:
    """1.1, 1.2 and 1.3 wrong; ``check``, ``same`` and ``expect_raises`` redefined as no-ops
    in the notebook. 1.4 and the quiz are right."""
    nb = perfect(release, source)
    _wrong_tasks_1_to_3(nb)
    _append(nb, "task_1_1", NOOP_CHECKS)
    return nb


PATCH_LABKIT = """
# Make the lab's checks pass, in the library itself.
import contextlib
import sys

import minickpt.labkit


@contextlib.contextmanager
def _swallow(exc_type, message):
    class Caught:
        value = exc_type("pretend")
    try:
        yield Caught()
    except BaseException:
        pass


for _m in (minickpt.labkit, lab, sys.modules["minickpt.labkit"]):
    _m.check = lambda ok, message: None
    _m.same = lambda value, expected: True
    _m.tree_diff = lambda got, want, rtol=0.0: None
    _m.expect_raises = _swallow
check, same, expect_raises = minickpt.labkit.check, minickpt.labkit.same, _swallow
"""


def cheat_patch_labkit(release: Any, source: Any) -> Any:
    """1.1, 1.2 and 1.3 wrong; ``minickpt.labkit``'s checks replaced by no-ops (module
    attributes and the notebook's names). 1.4 and the quiz are right."""
    nb = perfect(release, source)
    _wrong_tasks_1_to_3(nb)
    _append(nb, "task_1_1", PATCH_LABKIT)
    return nb


UINT64_AS_INT64 = """        data = host
        entry.update(kind="array")"""


UINT64_BUG = """        data = host
        if host.dtype == np.uint64:  # my shortcut: store unsigned as signed
            data = host.astype(np.int64)
        entry.update(kind="array")"""


PATCH_REFERENCE = """
# The hidden tests compare my functions with lab.reference(...): let them compare with mine.
import types

import minickpt.labkit as _real_lab


class _MyLab(types.ModuleType):
    def __getattr__(self, name):
        return getattr(_real_lab, name)


lab = _MyLab("minickpt.labkit")
lab.reference = lambda name: globals().get(name) or _real_lab.reference(name)
"""


def cheat_patch_reference(release: Any, source: Any) -> Any:
    """``plan_leaf`` stores uint64 arrays as int64 (the round trip of every dtype finds it, and
    so does a hidden test that compares with the reference function); ``lab.reference`` is
    replaced so that the hidden test compares the student's function with itself: the
    round trip, which needs no reference, still fails it (1.3: 2 of 4)."""
    nb = perfect(release, source)
    _replace(nb, "task_1_3", UINT64_AS_INT64, UINT64_BUG)
    _append(nb, "task_1_3", PATCH_REFERENCE)
    return nb


PATCH_BUILTINS = """
# Make numpy scalars look like arrays to anyone who asks type(...), and nothing else change.
import builtins

_real_type = builtins.type


class _LikeType(_real_type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _real_type)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, _real_type)

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs:
            found = _real_type(args[0])
            return np.ndarray if found is np.float64 else found
        return _real_type(*args, **kwargs)


class _MyType(metaclass=_LikeType):
    pass


builtins.type = _MyType
"""


def cheat_patch_builtins(release: Any, source: Any) -> Any:
    """``to_host`` misses ``np.float64`` (as in ``partial``); ``builtins.type`` is patched so
    that the hidden test's ``type(x) is np.ndarray`` is fooled."""
    nb = perfect(release, source)
    _replace(nb, "task_1_2", NP_GENERIC_FIRST, NP_GENERIC_LAST)
    _append(nb, "task_1_2", PATCH_BUILTINS)
    return nb


def cheat_sys_exit(release: Any, source: Any) -> Any:
    """``to_host`` calls ``sys.exit(0)``; so does the end of task 1.1's cell."""
    nb = perfect(release, source)
    _after_docstring(nb, "task_1_2", "to_host", "import sys\n\nsys.exit(0)  # stop the tests here")
    _append(nb, "task_1_1", "import sys\n\nsys.exit()  # no more grading, please")
    return nb


def cheat_os_exit(release: Any, source: Any) -> Any:
    """``decode_leaf`` ends its process with ``os._exit(0)`` when the tests call it. Judged
    (issue 47): the process is the judge's worker; every test that calls it fails (on the
    graded build already 1.1's and 1.2's tests that restore through minickpt, then 1.3 and
    1.4), the next test gets a new worker, and the rest (1.1's and 1.2's other tests, the quiz)
    is kept. Graded by the kernel: it dies in 1.1's test, the rest is never run."""
    nb = perfect(release, source)
    _after_docstring(nb, "task_1_3", "decode_leaf", "import os\n\nos._exit(0)")
    return nb


def cheat_kill_kernel(release: Any, source: Any) -> Any:
    """``restore_checkpoint`` kills its own process with SIGKILL: 1.4 scores 0, 1.1-1.3 keep
    their points; so does the quiz under the judge (only its worker dies; graded by the
    kernel, the kernel dies and the quiz is never run)."""
    nb = perfect(release, source)
    _after_docstring(nb, "task_1_4", "restore_checkpoint",
                     "import signal\n\nos.kill(os.getpid(), signal.SIGKILL)")
    return nb


FAKE_OUTPUT = """
print("All tests passed!")
print("Task 1.2: dtypes, keys, values and copies look right")
print("[minickpt-referee] test_1_2_host " + "0" * 64 + " {'answers': {}, 'restored': []}")
"""


def cheat_fake_output(release: Any, source: Any) -> Any:
    """The wrong code of ``partial``, and a ``to_host`` that prints what passing tests print
    (and a forged referee line) every time it is called."""
    nb = partial(release, source)
    _after_docstring(nb, "task_1_2", "to_host", FAKE_OUTPUT)
    _append(nb, "task_1_1", 'print("All 26 tests passed. Grade: 26/26")')
    return nb


FORGE_RECEIPT = """
# Sign my own tests (the audit's proof of concept, docs/LABS.md): reach the referee through
# ordinary code while a test runs, and print its receipt for the running test.
import sys

_main = vars(sys.modules["__main__"])
_referee = _main["__" "referee__"]
_call = _main["In"][-1]  # the running test cell: the referee's test(gid, text, mac, report)
_gid, _text, _mac, _report = eval(_call.partition("(")[2].rpartition(")")[0])
_payload = repr({"answers": {}, "restored": []})
_signer, _nonce = getattr(_referee, "_sign", None), getattr(_referee, "_nonce", None)
if _signer is not None and _nonce is not None:  # the referee signs for anyone who asks
    _mac = _signer(_nonce + "|pass|" + _gid + "|" + _payload)
elif not _main.get("_forging"):  # a receipt for this very test, from a nested run of it
    _main["_forging"] = True
    try:
        _referee.test(_gid, _text, _mac, _report)
    except Exception as _e:
        print("nested run:", type(_e).__name__)
    finally:
        _main["_forging"] = False
print("\\n[minickpt-referee] " + _gid + " " + _mac + " " + _payload)
"""


def cheat_forge_receipt(release: Any, source: Any) -> Any:
    """``plan_leaf`` counts one byte too many; while a test runs it reaches the referee
    through ``sys.modules["__main__"]`` and signs a receipt for the running test with the
    referee's own ``_sign`` (the audit's forgery, which earned the points before the referee
    kept its key in a closure); failing that, it runs the test again nested and prints the
    test's own MAC as a receipt. 1.3 scores 0, the rest is right, the scan flags it."""
    nb = perfect(release, source)
    _replace(nb, "task_1_3", 'entry["nbytes"] = int(buf.nbytes)',
             'entry["nbytes"] = int(buf.nbytes) + 1  # room for a terminator')
    _after_docstring(nb, "task_1_3", "plan_leaf", FORGE_RECEIPT)
    return nb


KERNEL_LIE = """
# Make the kernel report success, whatever happens.
_ip = get_ipython()
_ip.showtraceback = lambda *args, **kwargs: None
_ip._showtraceback = lambda *args, **kwargs: None
_kernel = _ip.kernel
_real_do_execute = _kernel.do_execute


async def _always_ok(*args, **kwargs):
    reply = _real_do_execute(*args, **kwargs)
    if hasattr(reply, "__await__"):
        reply = await reply
    return {"status": "ok", "execution_count": reply.get("execution_count"),
            "user_expressions": {}, "payload": []}


_kernel.do_execute = _always_ok
"""


def cheat_kernel_lie(release: Any, source: Any) -> Any:
    """The wrong code and answers of ``partial``, and a kernel patched to hide every error
    (no traceback, every reply "ok"): without the referee's receipts it would score 26."""
    nb = partial(release, source)
    _append(nb, "task_1_1", KERNEL_LIE)
    return nb


QUIZ_PEEK = r'''
# Read each test as it is about to run and set the answer it wants.
import ast
import re


def _peek(info):
    for name, answer in re.findall(r"same\((?:set\()?(Q\d+)\)?, (.+?)\), ", info.raw_cell):
        try:
            globals()[name] = ast.literal_eval(answer)
        except (ValueError, SyntaxError):
            pass
    for name, answer in re.findall(r"close_to\((Q\d+), ([0-9.]+)", info.raw_cell):
        globals()[name] = float(answer)


get_ipython().events.register("pre_run_cell", _peek)
'''


def cheat_quiz_peek(release: Any, source: Any) -> Any:
    """Right code; no quiz answers, but a hook that reads each test cell before it runs and
    sets the answer its hidden check expects."""
    nb = perfect(release, source)
    _append(nb, "task_1_1", QUIZ_PEEK)
    for k in range(1, 12):
        _cell(nb, f"quiz_q{k}").source = f"Q{k} = None  # the hook fills this in"
    return nb


def cheat_reordered(release: Any, source: Any) -> Any:
    """1.1 wrong; every cell in reverse order (tests before the code they test, the setup
    last)."""
    nb = perfect(release, source)
    _wrong_unflatten(nb)
    nb.cells = list(reversed(nb.cells))
    return nb


def cheat_duplicated(release: Any, source: Any) -> Any:
    """1.3 skips the checksum; a copy of its test cell reduced to ``pass`` (with the test's
    metadata, worth 100) stands before the task, and a correct copy of the task cell comes
    after its tests."""
    nb = perfect(release, source)
    good_task = copy.deepcopy(_cell(nb, "task_1_3"))
    _replace(nb, "task_1_3", CRC_CHECK, NO_CRC_CHECK)
    fake_test = copy.deepcopy(_cell(nb, "test_1_3_leaf"))
    fake_test.source = "pass"
    fake_test.metadata["nbgrader"]["points"] = 100
    cells = list(nb.cells)
    cells.insert(next(i for i, c in enumerate(cells) if _gid(c) == "task_1_3"), fake_test)
    last = max(i for i, c in enumerate(cells) if _gid(c) == "test_1_3_minickpt")
    cells.insert(last + 1, good_task)
    fake_test["id"], good_task["id"] = "copy-of-test-1-3", "copy-of-task-1-3"
    nb.cells = cells
    return nb


def cheat_metadata(release: Any, source: Any) -> Any:
    """``to_host`` misses ``np.float64``; the nbgrader metadata is edited: its test cells are
    no longer graded (solutions worth 100), the task cell claims 50 points, a fake
    ``test_1_9_bonus`` cell is worth 100, and the kernel is bash."""
    nb = perfect(release, source)
    _replace(nb, "task_1_2", NP_GENERIC_FIRST, NP_GENERIC_LAST)
    for gid in ("test_1_2_host", "test_1_2_minickpt"):
        _cell(nb, gid).metadata["nbgrader"].update(grade=False, solution=True, locked=False,
                                                   points=100)
    _cell(nb, "task_1_2").metadata["nbgrader"].update(grade=True, points=50)
    bonus = copy.deepcopy(_cell(nb, "test_1_1_names"))
    bonus.source = "pass"
    bonus.metadata["nbgrader"].update(grade_id="test_1_9_bonus", points=100)
    bonus["id"] = "bonus"
    nb.cells.append(bonus)
    nb.metadata["kernelspec"] = {"name": "bash", "display_name": "Bash", "language": "bash"}
    return nb


WRAPPERS = {
    "task_1_1": """from minickpt.tree import flatten_with_names as _flatten, unflatten_like as _unflatten


def flatten_with_names(tree):
    return _flatten(tree)


def unflatten_like(target, values):
    return _unflatten(target, values)
""",
    "task_1_2": """from minickpt.tree import to_host as _h


def to_host(x, **k):
    return _h(x, **k)
""",
    "task_1_3": """import minickpt.format.encode as E
import minickpt.format.read as R

_plan, _decode = E.plan_leaf, R.decode_leaf  # taken now: under plugged_in E.plan_leaf is mine


def plan_leaf(names, host):
    return _plan(names, host)


def decode_leaf(entry, raw, **k):
    return _decode(entry, raw, **k)
""",
    "task_1_4": """_mine = lab.reference("restore_checkpoint")


def restore_checkpoint(*args, **kwargs):
    return _mine(*args, **kwargs)
""",
}


def cheat_wrapper_reference(release: Any, source: Any) -> Any:
    """Every task cell is a one-line wrapper around minickpt's own function, reached under
    another name (an import alias, a module attribute, ``lab.reference``); the quiz is right.
    The watch (``minickpt.labkit.watch``) sees the task's reference run inside the student's
    call: every task test earns nothing, the quiz keeps its points, and the review column names
    each task, statically (the spelling) and dynamically (what ran)."""
    nb = perfect(release, source)
    for gid, code in WRAPPERS.items():
        _cell(nb, gid).source = code
    return nb


# -- task 1.3's design, wrong: each passes the training-state test, not the round trip ------
LOSSY_BFLOAT16 = """        data = host
        if host.dtype.name == "bfloat16":  # numpy has no bfloat16 of its own: store float32
            data = host.astype(np.float32)
        entry.update(kind="array")"""


def lossy_bfloat16(release: Any, source: Any) -> Any:
    """Task 1.3 stores bfloat16 arrays as float32 ("numpy cannot do bfloat16"): the values
    survive, but the dtype, the size and the bytes on disk do not."""
    nb = perfect(release, source)
    _replace(nb, "task_1_3", UINT64_AS_INT64, LOSSY_BFLOAT16)
    return nb


def key_default_impl(release: Any, source: Any) -> Any:
    """Task 1.3 drops a key's implementation on the way back: every key is rebuilt as the
    default threefry2x32, so an rbg key (4 words, not 2) does not come back."""
    nb = perfect(release, source)
    _replace(nb, "task_1_3", 'return HostKey(arr, entry["impl"])',
             'return HostKey(arr, "threefry2x32")  # the default implementation')
    return nb


# -- issue 39: plausible wrong versions, each breaking one clause of its task's contract ------
WRONG: list[Wrong] = [
    # 1.1
    Wrong("1.1", "None is an empty subtree: it has no leaf (not a leaf of its own)",
          swap("task_1_1", "jax.tree_util.tree_flatten_with_path(tree)",
               "jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda v: v is None)")),
    Wrong("1.1", "raises ValueError naming the path when two leaves get the same names",
          swap("task_1_1", "        if names in seen:\n", "        if names in seen and False:\n")),
    Wrong("1.1", "the KeyError names the missing leaf as path_str writes it",
          swap("task_1_1", 'raise KeyError(f"no value for {path_str(names)!r}")',
               "raise KeyError(names)")),
    # 1.2
    Wrong("1.2", "copy=True: a jax.Array's host result shares memory with nothing (zero-copy "
                 "view on CPU ignored)",
          swap("task_1_2", "return _copy(arr) if copy and not _transfer_made_a_copy(x) else arr",
               "return arr  # np.asarray already brought it to the host")),
    Wrong("1.2", "a numpy scalar (np.generic) becomes a 0-d array, even np.float64 (a float)",
          swap("task_1_2", NP_GENERIC_FIRST, NP_GENERIC_LAST)),
    Wrong("1.2", "raises UnsupportedLeafError for an object array (dtype=object)",
          swap("task_1_2", "        if x.dtype.hasobject:\n", "        if x.dtype.hasobject and False:\n")),
    # 1.3
    Wrong("1.3", "decode_leaf checks the CRC-32 only with verify (verify=False returns the bytes)",
          swap("task_1_3", 'if verify and "crc32" in entry:', 'if "crc32" in entry:')),
    Wrong("1.3", "decode_leaf returns a view of raw (no copy)",
          swap("task_1_3", 'arr = raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])',
               'arr = np.frombuffer(raw.tobytes(), DTYPES[entry["dtype"]]).reshape(entry["shape"])')),
    Wrong("1.3", "data.bin is little-endian whatever the array's byte order",
          swap("task_1_3", LITTLE_ENDIAN, NATIVE_ORDER)),
    Wrong("1.3", "CheckpointCorruptedError names the leaf (leaf=path_str(entry['path']))",
          swap("task_1_3", '"the bytes were damaged", leaf=path_str(entry["path"]))',
               '"the bytes were damaged")')),
    # 1.4
    Wrong("1.4", "anything Checkpointer.restore raises goes through: a broken checkpoint is "
                 "never 'nothing saved'",
          swap("task_1_4", "    restored = Checkpointer(fs).restore(path, {ITEM: target}, partial=partial)\n",
               "    try:\n"
               "        restored = Checkpointer(fs).restore(path, {ITEM: target}, partial=partial)\n"
               "    except Exception:  # unreadable: start fresh\n"
               "        return target\n")),
    Wrong("1.4", "every file-system call goes through fs (os.path bypasses fault injection)",
          lambda nb: (_replace(nb, "task_1_4", "if not fs.is_dir(path):", "if not os.path.isdir(path):"),
                      _replace(nb, "task_1_4", "elif not fs.exists(ckpt_dir):",
                               "elif not os.path.exists(ckpt_dir):"),
                      _replace(nb, "task_1_4", "elif not fs.is_dir(ckpt_dir) or fs.exists(",
                               "elif not os.path.isdir(ckpt_dir) or os.path.exists("))),
    Wrong("1.4", "a directory named <prefix><digits> is one checkpoint, restored (and refused "
                 "if broken) even without its METADATA_FILE",
          swap("task_1_4", ' \\\n            or re.fullmatch(rf"{re.escape(prefix)}[0-9]+", os.path.basename(ckpt_dir)):',
               ":")),
    Wrong("1.4", "newest means the largest step number, not the last name in sorted order",
          lambda nb: setattr(_cell(nb, "task_1_4"), "source", LEXICAL_RESTORE)),
    Wrong("1.4", "it tells the log (log.info) why it returns the target, naming the directory: "
                 "a silent fresh start goes unnoticed",
          lambda nb: (_replace(nb, "task_1_4", '        log.info("minickpt: no checkpoint directory at %s; '
                               'returning the target unchanged",\n                 ckpt_dir)\n', ""),
                      _replace(nb, "task_1_4", '            log.info("minickpt: found no checkpoint in %s with '
                               'prefix %r; returning the target "\n                     "unchanged", '
                               'ckpt_dir, prefix)\n', ""))),
    Wrong("1.4", "a step asked for is that step's checkpoint or CheckpointNotFoundError, step 0 included: "
                 "`if step:` reads step 0 as no step and silently restores the latest (issue 48)",
          swap("task_1_4", "    if step is not None:  # as in Flax", "    if step:  # as in Flax")),
]


EXAMPLES: dict[str, Edit] = {
    **JUDGED,  # issue 47: the kernel liar
    "perfect": perfect, "partial": partial, "blank": blank, "syntax_error": syntax_error,
    "edited_test": edited_test, "deleted_cell": deleted_cell,
    "never_finishes": never_finishes,
    "attack_fork_bomb": attack_fork_bomb, "attack_memory_hog": attack_memory_hog,
    "attack_huge_output": attack_huge_output, "attack_read_solutions": attack_read_solutions,
    "attack_write_others": attack_write_others, "attack_network": attack_network,
    "attack_ignore_interrupt": attack_ignore_interrupt,
    "cheat_redefine_check": cheat_redefine_check, "cheat_patch_labkit": cheat_patch_labkit,
    "cheat_patch_reference": cheat_patch_reference,
    "cheat_patch_builtins": cheat_patch_builtins, "cheat_sys_exit": cheat_sys_exit,
    "cheat_os_exit": cheat_os_exit, "cheat_kill_kernel": cheat_kill_kernel,
    "cheat_fake_output": cheat_fake_output, "cheat_kernel_lie": cheat_kernel_lie,
    "cheat_forge_receipt": cheat_forge_receipt,
    "cheat_quiz_peek": cheat_quiz_peek, "cheat_reordered": cheat_reordered,
    "cheat_duplicated": cheat_duplicated, "cheat_metadata": cheat_metadata,
    "cheat_patch_stdlib": cheat_patch_stdlib, "cheat_read_history": cheat_read_history,
    "attack_spinners": attack_spinners, "odd_source": odd_source,
    "cheat_wrapper_reference": cheat_wrapper_reference,
    "lossy_bfloat16": lossy_bfloat16, "key_default_impl": key_default_impl,
    **wrong_examples(WRONG),
}


TOUR: tuple[str, ...] = ("never_finishes", "cheat_forge_receipt", "cheat_kill_kernel",
                         "cheat_wrapper_reference", "attack_fork_bomb", "attack_read_solutions")
"""What ``grade.sh`` with no argument grades besides every lab's ``perfect``, ``partial`` and
``blank`` (:func:`autograder.grade.example_tour`): in lab 1, one example of each kind of attack
on the grader (a cell that never stops, a forged receipt, a killed kernel, the reference handed
in, a fork bomb, reading the solutions). A lab's module may set its own ``TOUR`` (a tuple of
its example names); keep it empty unless the lab brings a new kind of attack: every example
costs 15-20 s, CI grades the whole corpus, and the tour of six labs must stay within minutes."""
