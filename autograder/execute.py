"""Running one assembled notebook in a (sandboxed) kernel, whatever the student's code does.

nbclient's NotebookClient does the messaging; this subclass adds what grading hostile code
needs, with nbgrader's rules where it has them (errors allowed, a timed-out cell is interrupted
and the next one runs):

* **A kernel that dies** (``os._exit``, a kill, a crash, a CPU or memory limit) is not a failed
  submission: the cell it died in gets an error output that says so, every later cell is
  marked as not run, and the cells before it keep what they earned.
* **A kernel that ignores the interrupt** after a time-out (``signal.SIG_IGN``, a loop that
  catches ``KeyboardInterrupt``) is killed after a grace period, the same way.
* **Output is bounded**: per cell, what is kept in the notebook (the rest is counted, not
  stored) and what may be printed at all (then the cell is interrupted); a single message
  larger than the ZMQ limit is dropped by ZMQ before it is read. Receipt lines always get
  through, so a flood cannot hide a test that passed, and cannot forge one either.
* **Processes a cell leaves behind** (a fork bomb's children) are killed after every cell, and
  everything of the sandbox's uid when the notebook is done.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat import NotebookNode
from nbformat.v4 import new_output

from . import sandbox
from .referee import RECEIPT

MAX_ERRORS = 4
"""Error outputs kept per cell (each bounded); more are counted, and one says how many."""
FIELD_CHARS = 10_000
"""The longest ename/evalue/traceback line/prompt kept; metadata larger than this is dropped."""
SUBMISSION_KEEP_CHARS = 8 << 20
"""Characters of output kept for a whole submission, all its cells together (each cell keeps
at most ``keep_output_bytes`` of it): what reaches graded.ipynb, the feedback page and the
grading worker's memory. Past it, output is counted, not kept; a failing cell's error is
kept short (its name and message); the referee's signs still get through."""
SUBMISSION_OUTPUTS = 5_000
"""Outputs (notebook output entries) kept for a whole submission: a flood of tiny displays
costs the worker per entry, whatever its characters. Consecutive stream text is one entry."""
RECEIPT_CHARS = 200_000
"""The longest receipt line kept once the budget is spent (a genuine one is far shorter)."""
SHORT_EVALUE = 1_000
"""What of an error's message is kept once the budget is spent."""
NO_REPLY_GRACE = 5.0
"""Seconds a kernel that went idle may take to send its reply before it counts as broken."""


@dataclass
class RunReport:
    """What happened to the kernel, beyond the cells' outputs."""

    fate: str = ""                                  # "" when the kernel lived to the end
    fate_cell: int | None = None                    # index of the cell it ended in
    not_run: dict[int, str] = field(default_factory=dict)
    strays_killed: int = 0
    seconds: dict[int, float] = field(default_factory=dict)
    kernel_log: str = ""
    output_budget: str = ""                         # why output stopped being kept, if it did


def _error(ename: str, evalue: str) -> NotebookNode:
    return new_output("error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])


def _size(value: Any, limit: int = 1 << 40) -> int:
    """What a decoded message's value costs to keep: the characters of its strings and keys
    (8 for any other leaf), every field counted, stopping once past ``limit``."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str | bytes | bytearray | memoryview):
            total += len(v)
        elif isinstance(v, dict):
            total += 8 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            total += 8 * len(v)
            stack.extend(v)
        else:
            total += 8
    return total


def _short(value: Any, n: int = FIELD_CHARS) -> str:
    return str(value)[:n] if isinstance(value, str) else ""


def bounded_content(kind: str, content: Any) -> dict[str, Any] | None:
    """The part of an iopub message the grader keeps, every field bounded, or None to drop
    it: only the fields nbformat's outputs hold, of their types; anything else (comm
    messages, types no frontend knows, huge metadata) is never kept."""
    c = content if isinstance(content, dict) else {}
    count = c.get("execution_count")
    count = count if type(count) is int else None
    if kind == "status":
        return {"execution_state": _short(c.get("execution_state"), 16)}
    if kind == "stream":
        return {"name": "stderr" if c.get("name") == "stderr" else "stdout",
                "text": c.get("text") if isinstance(c.get("text"), str) else ""}
    if kind in ("display_data", "execute_result", "update_display_data"):
        data = c.get("data") if isinstance(c.get("data"), dict) else {}
        meta = c.get("metadata") if isinstance(c.get("metadata"), dict) else {}
        out: dict[str, Any] = {
            "data": {k[:100]: v for k, v in data.items() if isinstance(k, str)
                     and isinstance(v, str | dict | list)},
            "metadata": meta if _size(meta, FIELD_CHARS) <= FIELD_CHARS else {}}
        transient = c.get("transient")
        if isinstance(transient, dict) and isinstance(transient.get("display_id"), str):
            out["transient"] = {"display_id": transient["display_id"][:200]}
        if kind == "execute_result":
            out["execution_count"] = count
        return out
    if kind == "error":
        tb = c.get("traceback") if isinstance(c.get("traceback"), list) else []
        return {"ename": _short(c.get("ename"), 200) or "Error",
                "evalue": _short(c.get("evalue")),
                "traceback": [_short(t) for t in tb[-20:]]}
    if kind == "clear_output":
        return {"wait": c.get("wait") is True}
    if kind == "execute_input":
        return {"execution_count": count}
    return None


def _note(text: str) -> NotebookNode:
    return new_output("stream", name="stdout", text=f"[grader] {text}\n")


class GradingClient(NotebookClient):
    """See the module doc. ``uid`` is the sandbox's uid when processes can be told apart."""

    def __init__(self, nb: NotebookNode, km: Any, *, timeout: int, setup_timeout: int,
                 keep_output_bytes: int, max_output_bytes: int, interrupt_grace: int,
                 reap_uid: int | None, deadline: float | None = None,
                 on_ready: Any = None, after_first_cell: Any = None,
                 budget_chars: int = SUBMISSION_KEEP_CHARS,
                 budget_outputs: int = SUBMISSION_OUTPUTS) -> None:
        super().__init__(nb, km=km, timeout=timeout, allow_errors=True,
                         interrupt_on_timeout=True, raise_on_iopub_timeout=True,
                         iopub_timeout=interrupt_grace, shutdown_kernel="immediate",
                         record_timing=False, store_widget_state=False,
                         error_on_timeout={"ename": "CellTimeoutError", "evalue": "",
                                           "traceback": []})
        self.timeout_func = self._cell_timeout
        self._setup_timeout = setup_timeout
        self._keep = keep_output_bytes
        self._max = max_output_bytes
        self._reap_uid = reap_uid
        self._budget_chars, self._budget_outputs = budget_chars, budget_outputs
        self._spent = 0          # characters kept, the whole submission
        self._entries = 0        # outputs kept, the whole submission
        self._current = -1
        self._interrupting: asyncio.Future[Any] | None = None
        self._deadline = deadline
        self._on_ready, self._after_first = on_ready, after_first_cell
        self._kernel_pid: int | None = None
        self.report = RunReport()
        self._reset_cell()

    def _cell_timeout(self, cell: NotebookNode) -> int:
        role = cell.get("metadata", {}).get("minickpt", {}).get("role", "")
        t = max(self._setup_timeout, self.timeout) if role in ("setup", "referee") \
            else self.timeout
        if self._deadline is not None:  # never past the submission's own wall clock
            t = max(1, min(t, int(self._deadline - time.monotonic())))
        return t

    def _reset_cell(self) -> None:
        self._bytes = 0
        self._kept = 0
        self._dropped = 0
        self._flooded = False
        self._timed_out = False
        self._broken = False
        self._errors = 0
        self._errors_dropped = 0

    def process_message(self, msg: dict[str, Any], cell: NotebookNode, cell_index: int
                        ) -> NotebookNode | None:
        """Every message the kernel sends for a cell, whatever its type and fields, is
        counted whole (towards the cell's print limit) and reduced to
        :func:`bounded_content` before nbclient sees it: nothing else of it is kept."""
        kind = str(msg.get("msg_type", ""))
        whole = (_size(msg.get("content"), self._max) + _size(msg.get("metadata"), self._max)
                 + sum(len(b) for b in msg.get("buffers") or []))
        self._bytes += whole
        if self._bytes > self._max and not self._flooded:
            self._flooded = True
            self._interrupting = asyncio.ensure_future(self.km.interrupt_kernel())
        content = bounded_content(kind, msg.get("content"))
        if content is None:
            self._dropped += whole
            return None
        if kind == "error":
            self._errors += 1
            if self._errors > MAX_ERRORS:
                self._errors_dropped += 1
                return None
        if kind == "update_display_data":  # replaces kept data: it must fit what is left
            size = _size(content, self._keep)
            if size > self._keep - self._kept:
                self._dropped += size
                return None
            self._kept += size
        msg = {"msg_type": kind, "header": {"msg_type": kind}, "parent_header": {},
               "metadata": {}, "content": content}
        if kind == "status" and content.get("execution_state") == "idle":
            # idle after the request: its reply must be there too, or about to be. A kernel
            # whose own machinery the code broke goes idle and never replies; do not wait
            # out the whole time-out for every cell left.
            asyncio.get_event_loop().call_later(NO_REPLY_GRACE, self._no_reply, cell_index)
        return super().process_message(msg, cell, cell_index)

    def _no_reply(self, cell_index: int) -> None:
        task = getattr(self, "task_poll_for_reply", None)
        if task is not None and not task.done() and self._current == cell_index:
            self._broken = True
            task.cancel()

    # -- output limits -------------------------------------------------------------------
    def _over(self, what: str) -> None:
        """The submission's output budget is spent: said once, as the result's reason."""
        if not self.report.output_budget:
            self.report.output_budget = (
                f"its output passed what one submission may keep ({what}): the rest was "
                "counted, not kept (the cells still ran and were graded)")

    def _budget_words(self) -> str:
        return (f"{self._budget_chars >> 20} MiB" if self._spent >= self._budget_chars
                else f"{self._budget_outputs} outputs")

    def output(self, outs: list[NotebookNode], msg: dict[str, Any], display_id: str | None,
               cell_index: int) -> NotebookNode | None:
        """Keep an output within the cell's limit and the submission's budget
        (:data:`SUBMISSION_KEEP_CHARS` characters, :data:`SUBMISSION_OUTPUTS` outputs);
        stream text joins the cell's last output of the same stream."""
        content = msg.get("content", {})  # bounded already (process_message)
        kind = msg.get("msg_type")
        size = _size(content, self._max)
        left = self._budget_chars - self._spent
        full = self._entries >= self._budget_outputs
        if kind == "error":  # kept (MAX_ERRORS of them, bounded): it is what the student reads
            if size > left or full:  # short, past the budget: it still fails the cell
                content = {"ename": content.get("ename", "Error"), "traceback": [],
                           "evalue": str(content.get("evalue", ""))[:SHORT_EVALUE]}
                msg = {**msg, "content": content}
                size = _size(content)
                self._over(self._budget_words() if full else
                           f"{self._budget_chars >> 20} MiB")
            return self._keep_output(outs, msg, display_id, cell_index, size)
        room = min(self._keep - self._kept, left)
        if kind == "stream":
            text = str(content.get("text", ""))
            if len(text) > max(room, 0):
                receipts = [x[:RECEIPT_CHARS] for x in text[max(room, 0):].split("\n")
                            if x.startswith(RECEIPT)]
                self._dropped += len(text) - max(room, 0)
                if left < self._keep - self._kept:
                    self._over(f"{self._budget_chars >> 20} MiB")
                text = text[:max(room, 0)] + "".join(f"\n{r}\n" for r in receipts[-4:])
                if not text:
                    return None
            last = outs[-1] if outs else None
            if last is not None and not self.clear_before_next_output \
                    and last.get("output_type") == "stream" and last.get("name") == content.get("name"):
                last["text"] += text  # one entry per stream, however often it is flushed
                self._kept += len(text)
                self._spent += len(text)
                return None
            if full and not any(x.startswith(RECEIPT) for x in text.split("\n")):
                self._dropped += len(text)
                self._over(f"{self._budget_outputs} outputs")
                return None
            msg = {**msg, "content": {**content, "text": text}}
            return self._keep_output(outs, msg, display_id, cell_index, len(text))
        if size > room or full:
            self._dropped += size
            if size > left or full:
                self._over(self._budget_words() if full else f"{self._budget_chars >> 20} MiB")
            return None
        return self._keep_output(outs, msg, display_id, cell_index, size)

    def _keep_output(self, outs: list[NotebookNode], msg: dict[str, Any], display_id: str | None,
                     cell_index: int, size: int) -> NotebookNode | None:
        self._kept += size
        self._spent += size
        before = len(outs)
        out = super().output(outs, msg, display_id, cell_index)
        self._entries += max(0, len(outs) - before) or (out is not None)
        return out

    async def _async_handle_timeout(self, timeout: int, cell: NotebookNode | None = None
                                    ) -> dict[str, Any] | None:
        self._timed_out = True
        return await super()._async_handle_timeout(timeout, cell)

    # -- the run ---------------------------------------------------------------------------
    async def run(self, **kernel_kwargs: Any) -> RunReport:
        """Execute every code cell; never raises for what the notebook's code does.
        ``kernel_kwargs`` go to the kernel's launch (stdout, stderr, env, cwd)."""
        self.reset_execution_trackers()
        kernel_kwargs = {k: v for k, v in kernel_kwargs.items() if v is not None}
        async with self.async_setup_kernel(**kernel_kwargs):
            # nothing is ever read from stdin (input() is refused): close it, so that
            # what a kernel sends there is dropped by ZMQ instead of queued here
            self.kc.stdin_channel.close()
            await self.async_wait_for_reply(await _ensure(self.kc.kernel_info()))
            if self._reap_uid is not None:
                found = sandbox.processes_of(self._reap_uid)
                self._kernel_pid = found[0][1] if found else None
            if self._on_ready is not None:  # the kernel's sockets exist now
                self._on_ready()
            count = 0
            for index, cell in enumerate(self.nb.cells):
                if cell.cell_type != "code":
                    continue
                if self.report.fate:
                    self.report.not_run[index] = f"not run: {self.report.fate}"
                    cell.outputs = [_note(self.report.not_run[index])]
                    continue
                if not cell.source.strip():
                    continue
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self.report.fate = "the submission used up its time"
                    self.report.fate_cell = index
                    self.report.not_run[index] = f"not run: {self.report.fate}"
                    cell.outputs = [_note(self.report.not_run[index])]
                    continue
                count += 1
                self._reset_cell()
                self._current = index
                t0 = time.monotonic()
                try:
                    await self.async_execute_cell(cell, index, execution_count=count)
                except DeadKernelError:
                    if self._broken:
                        await self._kill()
                        self._end(index, cell, "KernelBroken", "the kernel stopped answering "
                                  "(the code broke its machinery); it was stopped")
                    else:
                        self._end(index, cell, "KernelDied", "the kernel died while this cell "
                                  "ran (os._exit, a kill, a crash, or a CPU-time or memory limit)")
                except CellTimeoutError:
                    await self._kill()
                    self._end(index, cell, "KernelUnresponsive",
                              f"the cell ran longer than {self._cell_timeout(cell)} s and did "
                              "not stop when interrupted; the kernel was stopped")
                except Exception as e:  # a kernel that sends garbage is the student's doing
                    await self._kill()
                    self._end(index, cell, "KernelMisbehaved",
                              f"the kernel's messages could not be read ({type(e).__name__}); "
                              "it was stopped")
                else:
                    self._after_cell(cell)
                self.report.seconds[index] = time.monotonic() - t0
                if count == 1 and self._after_first is not None:
                    self._after_first()
                self._reap(cell)
        return self.report

    def _after_cell(self, cell: NotebookNode) -> None:
        if self._timed_out and not any(o.get("ename") == "CellTimeoutError"
                                       for o in cell.outputs if o.output_type == "error"):
            cell.outputs.append(_error("CellTimeoutError", f"the cell ran longer than "
                                       f"{self._cell_timeout(cell)} s and was interrupted"))
        if self._dropped:
            cell.outputs.append(_note(f"{self._dropped} more characters of output were not kept"))
        if self._errors_dropped:
            cell.outputs.append(_error("OutputLimitExceeded", f"{self._errors_dropped} more "
                                       "error outputs were not kept"))
        if self._flooded:
            cell.outputs.append(_error("OutputLimitExceeded", f"the cell printed more than "
                                       f"{self._max >> 20} MiB and was interrupted"))

    def _end(self, index: int, cell: NotebookNode, ename: str, evalue: str) -> None:
        cell.outputs.append(_error(ename, evalue))
        where = cell.get("metadata", {}).get("minickpt", {}).get("grade_id") or f"cell {index}"
        self.report.fate = f"{evalue.split(';')[0].split(' (')[0]} in {where}"
        self.report.fate_cell = index

    async def _kill(self) -> None:
        try:
            await _ensure(self.km.shutdown_kernel(now=True))
        except Exception:
            pass

    def _reap(self, cell: NotebookNode) -> None:
        if self._reap_uid is None:
            return
        keep = None if self.report.fate else self._kernel_pid
        killed = sandbox.kill_uid(self._reap_uid, keep=keep)
        if killed and not self.report.fate:
            cell.outputs.append(_note(f"stopped {killed} process(es) this cell left running"))
        self.report.strays_killed += killed


async def _ensure(x: Any) -> Any:
    return await x if asyncio.iscoroutine(x) or isinstance(x, asyncio.Future) else x
