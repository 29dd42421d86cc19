"""The tiered mirror against a real S3 API: moto's server on localhost, reached through s3fs
over HTTP, and a fault proxy in front of it that resets a connection, answers 503 SlowDown,
or cuts a response short at the N-th request of an upload.

The server is a subprocess started and stopped here (127.0.0.1, a free port, bounded waits);
the credentials are fake and given explicitly, and the AWS configuration files and the
instance-metadata lookup are switched off, so nothing leaves this machine.
"""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
import warnings

import numpy as np
import pytest
from conftest import tree_equal

from minickpt import CheckpointManagerOptions
from minickpt.errors import CheckpointNotFoundError, StepAlreadyExistsError
from minickpt.production.mirror import (
    COMMIT_SUCCESS_FILE,
    LEASE_FILE,
    UPLOAD_MARKER,
    FsspecStore,
    LeaseHeldError,
    LeaseLostError,
    MirrorError,
)
from minickpt.production.tiered import TieredCheckpointManager

if os.environ.get("CI"):  # CI installs the test extra: a missing package is a failure there
    import moto  # noqa: F401
    import s3fs  # noqa: F401
else:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")

BUCKET = "minickpt-mirror"
REGION = "us-west-2"  # us-east-1 refuses an explicit location constraint on create_bucket
FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION,
    "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}
OPTS = CheckpointManagerOptions(max_to_keep=None)
WAIT_S = 60  # every wait for the mirror is bounded


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto(log_path):
    """moto's S3 server in its own process; returns (process, endpoint) once it answers."""
    env = {**os.environ, **FAKE_AWS_ENV}
    for _attempt in range(3):  # the free port may be taken between the probe and the bind
        port = _free_port()
        log = open(log_path, "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        log.close()
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                return proc, endpoint
            except OSError:
                time.sleep(0.1)
        _stop(proc)
    with open(log_path, encoding="utf-8", errors="replace") as f:
        raise RuntimeError(f"moto's server did not start in 3 tries; its log:\n{f.read()[-3000:]}")


def _stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The endpoint of a fresh moto S3 server holding one empty bucket."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in FAKE_AWS_ENV.items():
            mp.setenv(k, v)
        proc, endpoint = _start_moto(tmp_path_factory.mktemp("moto") / "server.log")
        try:
            _fs(endpoint).mkdir(BUCKET)
            yield endpoint
        finally:
            _stop(proc)


def _fs(endpoint, **kw):
    import s3fs

    return s3fs.S3FileSystem(**_options(endpoint), **kw)


def _options(endpoint, client_retries=False):
    """s3fs's options for ``endpoint``. Without ``client_retries`` botocore and s3fs try each
    request once, so that every fault reaches the mirror's own retry."""
    opts = {"key": "testing", "secret": "testing", "endpoint_url": endpoint,
            "client_kwargs": {"region_name": REGION}, "skip_instance_cache": True,
            "config_kwargs": {"connect_timeout": 5, "read_timeout": 15}}
    if not client_retries:
        opts["config_kwargs"]["retries"] = {"total_max_attempts": 1, "mode": "standard"}
    return opts


def _store(endpoint, prefix, client_retries=False):
    store = FsspecStore(f"s3://{BUCKET}/{prefix}", **_options(endpoint, client_retries))
    if not client_retries:
        store.fs.retries = 1  # s3fs's own retry of dropped connections (a class attribute)
    return store


def _items(v):
    return {"params": {"w": np.full((32, 4), float(v), np.float32),
                       "b": np.arange(4.0) + v},
            "step": {"n": np.int64(v)}}


def _prefix():
    return f"run-{uuid.uuid4().hex[:12]}"


def _restore_on_a_new_machine(tmp_path, store):
    """A fresh local disk on the same mirror (``store``, reached directly): what a reader
    sees, and what it restores."""
    local = tmp_path / f"new-{uuid.uuid4().hex[:8]}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with TieredCheckpointManager(local, store, OPTS) as m:
            steps = m.mirror_steps()
            r = m.restore() if steps else None
    shutil.rmtree(local, ignore_errors=True)
    return steps, r


# ---------------------------------------------------------------------------------------
# the fault proxy
# ---------------------------------------------------------------------------------------
SLOW_DOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
             b"<Message>Please reduce your request rate.</Message>"
             b"<RequestId>minickpt-fault</RequestId></Error>")


class FaultProxy:
    """A threaded HTTP proxy on 127.0.0.1 in front of the S3 server, one request per
    connection (it answers ``Connection: close``). Once armed with ``(mode, at)`` it counts
    requests from 0 and at request ``at``:

    - ``"reset"``: forwards it (the server acts on it), then resets the connection without a
      response: the client cannot know whether its PUT or DELETE happened (aiohttp resends
      an idempotent request once at once: that resend is reset too);
    - ``"503"``: answers 503 SlowDown without forwarding it (S3's throttling);
    - ``"truncate"``: forwards it, then sends half of the response (half its body, or half
      its head when it has none) and closes;
    - ``"outage"``: resets that request and every later one without forwarding them: the
      network is gone for the rest of the upload, so nothing can be cleaned up either.
    """

    def __init__(self, upstream, port=0):
        host, up_port = upstream.rsplit("//", 1)[1].split(":")
        self.upstream = (host, int(up_port))
        self.sock = socket.create_server(("127.0.0.1", port))
        self.sock.settimeout(0.2)
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.lock = threading.Lock()
        self.mode, self.at, self.count, self.faulted, self._last = None, -1, 0, 0, None
        self.log = []  # (index, method, path) of the requests seen since arm()
        self._stop = threading.Event()
        self._threads = []
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    def arm(self, mode, at):
        """Fault request ``at`` (counted from now) with ``mode``; ``None``: count only."""
        with self.lock:
            self.mode, self.at, self.count, self.faulted, self.log = mode, at, 0, 0, []
            self._last = None

    def disarm(self):
        with self.lock:
            self.mode = None

    def close(self):
        self._stop.set()
        self._accept.join(timeout=10)
        for t in self._threads:
            t.join(timeout=10)
        self.sock.close()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _handle(self, conn):
        with contextlib.closing(conn):
            conn.settimeout(20)
            try:
                head, body = _read_request(conn)
            except (OSError, ValueError):
                return
            if head is None:
                return
            method, target = head.split(b"\r\n", 1)[0].split(b" ")[:2]
            with self.lock:
                i = self.count
                self.count += 1
                req = (method, target)
                # aiohttp sends an idempotent request once more when the connection closed
                # before a status line came: that resend (the same request, next in line) is
                # faulted too, so that the fault reaches the mirror, not absorbed below it
                again = self._last == (i - 1, req) and i - 1 == self.at
                fault = self.mode if self.mode is not None and (
                    i == self.at or again or (self.mode in ("outage", "hang") and i > self.at)
                ) else None
                if fault:
                    self.faulted += 1
                # (index, method, target, whether the server saw it)
                self.log.append((i, method.decode(), target.decode(),
                                 fault not in ("503", "outage")))
            if fault in ("outage",):
                return _reset(conn)
            if fault == "hang":  # connection accepted, request read, never an answer
                self._stop.wait()
                return
            if fault == "503":
                conn.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n"
                             % len(SLOW_DOWN) + (b"" if method == b"HEAD" else SLOW_DOWN))
                return
            try:
                response = self._forward(_upstream_request(head, body))
            except OSError:
                return _reset(conn)
            rhead, _, rbody = response.partition(b"\r\n\r\n")
            if fault == "reset" or (fault == "truncate" and not rbody):
                with self.lock:  # no status line reaches the client: it resends
                    self._last = (i, req)
            if fault == "reset":
                return _reset(conn)
            if fault == "truncate":
                conn.sendall((rhead + b"\r\n\r\n" + rbody[:len(rbody) // 2]) if rbody
                             else rhead[:len(rhead) // 2])
                return
            with contextlib.suppress(OSError):
                conn.sendall(response)

    def _forward(self, request):
        with socket.create_connection(self.upstream, timeout=20) as up:
            up.sendall(request)
            chunks = []
            while c := up.recv(1 << 16):
                chunks.append(c)
        rhead, sep, rbody = b"".join(chunks).partition(b"\r\n\r\n")
        lines = [ln for ln in rhead.split(b"\r\n")
                 if not ln.lower().startswith(b"connection:")]
        return b"\r\n".join([*lines, b"Connection: close"]) + sep + rbody


def _reset(conn):
    """Close with an RST, as a crashed peer or a middlebox does."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")


def _read_request(conn):
    """(head, body) of one HTTP request; answers ``Expect: 100-continue`` itself."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        c = conn.recv(1 << 16)
        if not c:
            return None, None
        buf += c
        if len(buf) > 1 << 20:
            raise ValueError("request head too long")
    head, _, rest = buf.partition(b"\r\n\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (ln.partition(b":") for ln in head.split(b"\r\n")[1:])}
    if headers.get(b"expect", b"").lower() == b"100-continue":
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while not (rest.endswith(b"0\r\n\r\n") and _chunked_done(rest)):
            c = conn.recv(1 << 16)
            if not c:
                raise ValueError("chunked body cut short")
            rest += c
        return head, rest
    n = int(headers.get(b"content-length", b"0"))
    while len(rest) < n:
        c = conn.recv(min(1 << 20, n - len(rest)))
        if not c:
            raise ValueError("body cut short")
        rest += c
    return head, rest


def _chunked_done(body):
    i = 0
    while True:
        j = body.find(b"\r\n", i)
        if j < 0:
            return False
        size = int(body[i:j].split(b";")[0], 16)
        i = j + 2 + size + 2
        if size == 0:
            return i <= len(body)
        if i > len(body):
            return False


def _upstream_request(head, body):
    lines = [ln for ln in head.split(b"\r\n")
             if not ln.lower().startswith((b"connection:", b"expect:"))]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + body


@pytest.fixture(scope="module")
def proxy(s3):
    p = FaultProxy(s3)
    try:
        yield p
    finally:
        p.close()


# ---------------------------------------------------------------------------------------
# a mirror on S3
# ---------------------------------------------------------------------------------------
def test_a_run_mirrored_to_s3_is_restored_on_a_new_machine(tmp_path, s3):
    prefix = _prefix()
    with TieredCheckpointManager(tmp_path / "local", _store(s3, prefix),
                                 CheckpointManagerOptions(max_to_keep=2),
                                 backoff_s=0.01) as m:
        for s in range(4):
            m.save(s, _items(s))
        m.wait_until_mirrored(timeout=WAIT_S)
        assert m.mirror_steps() == [2, 3]
    fs = _fs(s3)
    root = f"{BUCKET}/{prefix}"
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(root)) == [LEASE_FILE, "step_2", "step_3"]
    for s in (2, 3):
        local = tmp_path / "local" / f"step_{s}"
        files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
        remote = sorted(p[len(f"{root}/step_{s}/"):] for p in fs.find(f"{root}/step_{s}"))
        assert remote == sorted([*files, COMMIT_SUCCESS_FILE])
        for f in files:  # byte for byte, as uploaded over HTTP
            assert fs.cat_file(f"{root}/step_{s}/{f}") == (local / f).read_bytes()
    steps, r = _restore_on_a_new_machine(tmp_path, _store(s3, prefix))
    assert steps == [2, 3] and r.step == 3 and tree_equal(dict(r), _items(3))




def test_a_step_without_its_commit_marker_is_never_listed_nor_restored(tmp_path, s3):
    prefix = _prefix()
    with TieredCheckpointManager(tmp_path / "local", _store(s3, prefix), OPTS) as m:
        for s in range(3):
            m.save(s, _items(s))
        m.wait_until_mirrored(timeout=WAIT_S)
    fs, root = _fs(s3), f"{BUCKET}/{prefix}"
    # step 2 with every file, its metadata too, but no marker: an upload cut short at the end
    fs.rm_file(f"{root}/step_2/{COMMIT_SUCCESS_FILE}")
    # step 1 loses its marker after a reader has listed it (another job deleting it)
    local = tmp_path / "reader"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with TieredCheckpointManager(local, _store(s3, prefix), OPTS) as m:
            assert m.mirror_steps() == [0, 1]  # step 2 is not listed ...
            # ... and, carrying no in-progress marker of a writer that is gone, not removed
            assert fs.exists(f"{root}/step_2/_CHECKPOINT_METADATA")
            fs.rm_file(f"{root}/step_1/{COMMIT_SUCCESS_FILE}")
            r = m.restore()  # the marker is checked again on restore: the newest complete
            assert r.step == 0 and tree_equal(dict(r), _items(0))
            assert m.mirror_steps() == [0]
            with pytest.raises(CheckpointNotFoundError):
                m.restore(1)
    assert any("skipping step 1" in str(w.message) for w in caught)


# ---------------------------------------------------------------------------------------
# faults at every request of an upload
# ---------------------------------------------------------------------------------------
MODES = ("reset", "503", "truncate")


def _files(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def _check_marker_last(log, want, step):
    """On the wire: the commit marker of ``step`` is PUT only after every file of the step
    was PUT and then read back (GET) since the last delete; returns how many were PUT."""
    put, read, markers, key = set(), set(), 0, f"/step_{step}"
    for _, method, target, reached in log:
        if not reached or (key not in target and "delete" not in target):
            continue
        name = target.split(f"{key}/", 1)[-1].split("?")[0]
        if method == "DELETE" or (method == "POST" and "delete" in target):
            put, read = set(), set()
        elif method == "PUT" and name == COMMIT_SUCCESS_FILE:
            assert put >= want, f"marker written before {sorted(want - put)}"
            data = {f for f in want if f.endswith(("data.bin", "manifest.json"))}
            assert read >= data, f"marker written before {sorted(data - read)} was re-read"
            markers += 1
        elif method == "PUT":
            put.add(name)
        elif method == "GET" and name in put:
            read.add(name)
    return markers


def _upload(m, proxy, mode, n, step):
    """Save ``step`` and wait for its copy with request ``n`` of the upload faulted; returns
    (copied, the manager's mirror events)."""
    events = []
    m.listeners.append(lambda ev, rec: events.append(rec) if ev == "mirror" else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proxy.arm(mode, n)
        try:
            m.save(step, _items(step))
            m.wait_until_mirrored(timeout=WAIT_S)
            ok = True
        except MirrorError:
            ok = False
        finally:
            proxy.disarm()
            m.listeners.pop()
    assert mode is None or proxy.faulted >= 1, (mode, n)
    return ok, events


def test_faults_at_every_request_of_an_upload(tmp_path, s3, proxy):
    """A fault at each request index of one step's upload (reset, 503 SlowDown, truncated
    response: one per index, each in turn; every mode at every index with
    MINICKPT_S3_FAULTS=all), then an outage from each request index on, which leaves the
    upload half done with nothing able to clean it up."""
    fs = _fs(s3)
    stats = {"requests_per_upload": 0, "uploads": 0, "requests_faulted": 0,
             "attempts_failed": 0, "steps_lost": 0, "partial_steps_published": 0,
             "outage_left_partial": 0, "restored_older_step": 0}

    # -- one fault per upload: the mirror's retry gets every step through ------------------
    prefix, local = _prefix(), tmp_path / "local"
    store = _store(proxy.endpoint, prefix)
    with TieredCheckpointManager(local, store, OPTS, max_attempts=3, backoff_s=0.001,
                                 max_backoff_s=0.002) as m:
        m.save(1, _items(1))
        m.wait_until_mirrored(timeout=WAIT_S)
        assert _upload(m, proxy, None, -1, 2)[0]
        requests = stats["requests_per_upload"] = proxy.count  # one upload, no fault
        assert _check_marker_last(proxy.log, set(_files(local / "step_2")), 2) == 1
        modes = MODES if os.environ.get("MINICKPT_S3_FAULTS") == "all" else None
        cases = [(mode, n) for n in range(requests) for mode in modes or [MODES[n % 3]]]
        for step, (mode, n) in enumerate(cases, start=3):
            ok, events = _upload(m, proxy, mode, n, step)
            assert ok and m.mirror_steps()[-1] == step, (mode, n, events)
            # the fault reached the mirror (not absorbed below it): one failed attempt, retried
            assert [e["ok"] for e in events] == [False, True], (mode, n, events)
            stats["uploads"] += 1
            stats["requests_faulted"] += proxy.faulted
            stats["attempts_failed"] += sum(not e["ok"] for e in events)
            assert _check_marker_last(proxy.log, set(_files(local / f"step_{step}")), step)
        steps = list(range(1, 3 + len(cases)))
    # what a reader finds: every step, each whole, byte for byte
    files = {f"{BUCKET}/{prefix}/step_{s}/{f}": b for s in steps
             for f, b in _files(local / f"step_{s}").items()}
    got = fs.cat(list(files))
    stats["partial_steps_published"] += sum(got[k] != b for k, b in files.items())
    listed, r = _restore_on_a_new_machine(tmp_path, _store(s3, prefix))
    stats["steps_lost"] += len(set(steps) - set(listed))
    assert listed == steps and r.step == steps[-1] and tree_equal(dict(r), _items(r.step))

    # -- an outage from request n on: a partial upload is never listed nor restored ---------
    prefix, local = _prefix(), tmp_path / "local-outage"
    root = f"{BUCKET}/{prefix}"
    # (a store is an s3fs client: made once, as botocore loads S3's API model for each)
    proxied, direct = _store(proxy.endpoint, prefix), _store(s3, prefix)
    with TieredCheckpointManager(local, proxied, OPTS) as m:
        m.save(1, _items(1))  # the complete step a restore falls back to
    for n in range(requests):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = TieredCheckpointManager(local, proxied, OPTS, max_attempts=1)
            ok, events = _upload(m, proxy, "outage", n, 2)
            with contextlib.suppress(MirrorError):  # raised again: the copy failed
                m.close()
        stats["uploads"] += 1
        stats["requests_faulted"] += proxy.faulted
        stats["attempts_failed"] += sum(not e["ok"] for e in events)
        committed = fs.exists(f"{root}/step_2/{COMMIT_SUCCESS_FILE}")
        assert ok or not events[-1]["ok"], (n, events)  # a failed copy is reported
        assert (local / "step_2").is_dir()  # not mirrored: the local copy is kept
        left = not committed and fs.exists(f"{root}/step_2")
        stats["outage_left_partial"] += left
        listed, r = _restore_on_a_new_machine(tmp_path, direct)  # cleans up, too
        assert listed == ([1, 2] if committed else [1]), (n, listed)
        assert r.step == listed[-1] and tree_equal(dict(r), _items(r.step))
        if committed:  # published: then whole, byte for byte
            now = _files(local / "step_2")
            got = fs.cat([f"{root}/step_2/{f}" for f in now])
            stats["partial_steps_published"] += any(
                got[f"{root}/step_2/{f}"] != b for f, b in now.items())
        stats["restored_older_step"] += r.step == 1
        stats["steps_lost"] += 1 not in listed
        assert not fs.exists(f"{root}/step_2") or committed  # the partial upload removed
        if fs.exists(f"{root}/step_2"):
            fs.rm(f"{root}/step_2", recursive=True)
        shutil.rmtree(local / "step_2")
    print("\nS3 mirror faults:", json.dumps(stats))
    if os.environ.get("MINICKPT_S3_FAULT_REPORT"):
        with open(os.environ["MINICKPT_S3_FAULT_REPORT"], "w") as f:
            json.dump(stats, f)
    assert stats["steps_lost"] == 0 and stats["partial_steps_published"] == 0
    assert stats["outage_left_partial"] > 0 and stats["restored_older_step"] > 0


# ---------------------------------------------------------------------------------------
# what the mirror owns, who changes it, and how it ends (issue 42)
# ---------------------------------------------------------------------------------------
def test_a_mirror_sharing_its_prefix_touches_only_its_own_step_folders(tmp_path, s3):
    """Other data under the run's prefix and at the bucket root, and a mirror at each."""
    fs, prefix = _fs(s3), _prefix()
    others = {
        f"{BUCKET}/{prefix}/tensorboard/events.out.tfevents.1": b"tb",
        f"{BUCKET}/{prefix}/config/run.yaml": b"lr: 0.1\n",
        f"{BUCKET}/{prefix}/step_7/notes.txt": b"a step-named folder, no marker: not ours",
        f"{BUCKET}/{prefix}/step_8.minickpt-tmp-0badc0de/x": b"no marker either",
        f"{BUCKET}/{prefix}/other-run/step_1/_CHECKPOINT_METADATA": b"{}",
        f"{BUCKET}/dataset-{prefix}/shard-00000.tfrecord": os.urandom(4096),
    }
    for k, v in others.items():
        fs.pipe_file(k, v)
    for i, mirror_prefix in enumerate((prefix, "")):  # the run's prefix, the bucket root
        with TieredCheckpointManager(tmp_path / f"local{i}", _store(s3, mirror_prefix),
                                     CheckpointManagerOptions(max_to_keep=1),
                                     backoff_s=0.01) as m:
            for s in range(3):
                m.save(100 * i + s, _items(s))
            m.wait_until_mirrored(timeout=WAIT_S)
            assert m.mirror_steps() == [100 * i + 2]
        fs.invalidate_cache()
        for k, v in others.items():
            assert fs.cat_file(k) == v, k
    fs.rm(f"{BUCKET}/step_102", recursive=True)


class PausingStore(FsspecStore):
    """Holds the upload of one step after its metadata, just before its commit marker."""

    def __init__(self, url, step, **kw):
        super().__init__(url, **kw)
        self.key = f"step_{step}/_CHECKPOINT_METADATA"
        self.reached, self.go = threading.Event(), threading.Event()

    def write_file(self, rel, chunks):
        n = super().write_file(rel, chunks)
        if rel == self.key and not self.go.is_set():
            self.reached.set()
            self.go.wait(WAIT_S)
        return n


@pytest.mark.timeout(120)
def test_an_evaluation_job_reading_beside_the_trainer_changes_nothing(tmp_path, s3):
    from minickpt import CheckpointManager

    prefix = _prefix()
    store = PausingStore(f"s3://{BUCKET}/{prefix}", 1, **_options(s3))
    eval_local = tmp_path / "eval"
    with CheckpointManager(eval_local) as c:  # the evaluator's cache holds a step of its own
        c.save(5, _items(5))
    try:
        with TieredCheckpointManager(tmp_path / "trainer", store,
                                     CheckpointManagerOptions(max_to_keep=3)) as t:
            t.save(0, _items(0))
            t.wait_until_mirrored(timeout=WAIT_S)
            t.save(1, _items(1))
            assert store.reached.wait(WAIT_S)  # step 1 uploaded, not yet committed
            ro = CheckpointManagerOptions(max_to_keep=1, read_only=True)
            with TieredCheckpointManager(eval_local, _store(s3, prefix), ro) as ev:
                assert ev.mirror_steps() == [0]
                r = ev.restore(0)
                assert tree_equal(dict(r), _items(0))
            store.go.set()
            t.wait_until_mirrored(timeout=WAIT_S)
    finally:
        store.go.set()
    fs = _fs(s3)
    assert not fs.exists(f"{BUCKET}/{prefix}/step_5")  # a reader never uploads ...
    steps, r = _restore_on_a_new_machine(tmp_path, _store(s3, prefix))
    assert steps == [0, 1]  # ... nor deletes (its max_to_keep=1)
    assert r.step == 1 and tree_equal(dict(r), _items(1))  # the trainer's upload is whole


@pytest.mark.timeout(60)
def test_close_is_bounded_when_s3_accepts_connections_but_never_answers(tmp_path, s3):
    p = FaultProxy(s3)
    try:
        m = TieredCheckpointManager(tmp_path / "local", _store(p.endpoint, _prefix()), OPTS,
                                    close_timeout=2)
        m.save(0, _items(0))
        m.wait_until_mirrored(timeout=WAIT_S)
        p.arm("hang", 0)
        m.save(1, _items(1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(MirrorError, match="close_timeout"):
                m.close()  # within the test's time-out, far below the client's retries
        assert (tmp_path / "local" / "step_1").is_dir()  # kept for the next manager
    finally:
        p.close()


EXIT_SCRIPT = """
import json, sys
import numpy as np
from minickpt import CheckpointManagerOptions
from minickpt.production.mirror import FsspecStore
from minickpt.production.tiered import TieredCheckpointManager
store = FsspecStore(sys.argv[1], **json.loads(sys.argv[2]))
m = TieredCheckpointManager(sys.argv[3], store, CheckpointManagerOptions(max_to_keep=None))
for s in range(3):
    m.save(s, {"x": {"w": np.full(4096, s, np.float32)}})
# the script ends without m.close()
"""


@pytest.mark.timeout(180)
def test_exit_without_close_finishes_the_copies_with_a_true_message(tmp_path, s3):
    prefix = _prefix()
    env = {**os.environ, **FAKE_AWS_ENV, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, f"s3://{BUCKET}/{prefix}",
         json.dumps(_options(s3)), str(tmp_path / "local")],
        env=env, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr
    assert "Could not connect" not in p.stderr, p.stderr
    assert "was not closed" in p.stderr, p.stderr
    steps, r = _restore_on_a_new_machine(tmp_path, _store(s3, prefix))
    assert steps == [0, 1, 2] and r.step == 2


def test_the_cli_lists_and_verifies_a_mirror_on_s3(tmp_path, s3, monkeypatch, capsys):
    from minickpt.cli import main

    prefix = _prefix()
    url = f"s3://{BUCKET}/{prefix}"
    with TieredCheckpointManager(tmp_path / "local", _store(s3, prefix), OPTS) as m:
        for s in range(2):
            m.save(s, _items(s))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3)  # what an operator's shell would set
    assert main(["ls", url]) == 0
    assert main(["verify", url]) == 0
    out = capsys.readouterr().out
    assert "step 0" in out and "step 1" in out and "VALID" in out
    fs = _fs(s3)
    path = f"{BUCKET}/{prefix}/step_1/params/data.bin"
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 1  # a flipped bit: only the checksums see it
    fs.pipe_file(path, bytes(data))
    assert main(["verify", url]) == 1
    assert "DAMAGED" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# the mirror owns its run (issue 49)
# ---------------------------------------------------------------------------------------
def _objects(fs, root):
    """Every object under ``root`` but the lease, with its bytes."""
    fs.invalidate_cache()
    keys = [k for k in fs.find(root) if not k.endswith(LEASE_FILE)]
    return dict(zip(keys, [fs.cat_file(k) for k in keys], strict=True))


def _quiet():
    cm = warnings.catch_warnings()
    cm.__enter__()
    warnings.simplefilter("ignore")
    return cm


@pytest.mark.timeout(120)
def test_a_second_trainer_on_the_prefix_is_refused_and_changes_nothing(tmp_path, s3):
    fs, prefix = _fs(s3), _prefix()
    root = f"{BUCKET}/{prefix}"
    first = TieredCheckpointManager(tmp_path / "vm1", _store(s3, prefix),
                                    CheckpointManagerOptions(max_to_keep=2), backoff_s=0.01)
    try:
        for s in (100, 200):
            first.save(s, _items(s))
        first.wait_until_mirrored(timeout=WAIT_S)
        before = _objects(fs, root)
        # the replacement VM starts while the preempted one is still alive
        with pytest.raises(LeaseHeldError) as e:
            TieredCheckpointManager(tmp_path / "vm2", _store(s3, prefix),
                                    CheckpointManagerOptions(max_to_keep=1), backoff_s=0.01)
        msg = str(e.value)
        assert first.writer.id in msg and "force=True" in msg and "stale" in msg, msg
        assert _objects(fs, root) == before  # nothing of the first run changed
        assert not (tmp_path / "vm2" / "step_200").exists()
        # a reader needs no lease
        ro = CheckpointManagerOptions(read_only=True)
        with TieredCheckpointManager(tmp_path / "eval", _store(s3, prefix), ro) as ev:
            assert ev.mirror_steps() == [100, 200]
        # taken over on purpose: the old writer stops at its next change
        cm = _quiet()
        try:
            second = TieredCheckpointManager(tmp_path / "vm2", _store(s3, prefix),
                                             CheckpointManagerOptions(max_to_keep=2),
                                             backoff_s=0.01, max_attempts=1, force=True)
            first.save(300, _items(300))
            with pytest.raises(MirrorError, match="no longer holds the lease"):
                first.wait_until_mirrored(timeout=WAIT_S)
        finally:
            cm.__exit__(None, None, None)
        assert not fs.exists(f"{root}/step_300")  # the fenced writer published nothing
        with pytest.raises(LeaseLostError):
            first.save(400, _items(400))  # and the superseded trainer is told at once
        with pytest.raises(StepAlreadyExistsError):
            second.save(200, _items(-200))  # the run's step 200 is never replaced
        second.save(300, _items(-300))
        second.close()
    finally:
        with contextlib.suppress(MirrorError):
            first.close()
    steps, r = _restore_on_a_new_machine(tmp_path, _store(s3, prefix))
    assert steps == [200, 300] and tree_equal(dict(r), _items(-300))
    assert fs.cat_file(f"{root}/step_200/params/data.bin") == \
        before[f"{root}/step_200/params/data.bin"]


@pytest.mark.timeout(120)
def test_a_save_over_a_step_only_the_mirror_holds_is_refused(tmp_path, s3):
    fs, prefix = _fs(s3), _prefix()
    root = f"{BUCKET}/{prefix}"
    with TieredCheckpointManager(tmp_path / "vm1", _store(s3, prefix),
                                 CheckpointManagerOptions(max_to_keep=1),
                                 mirror_max_to_keep=None) as m:
        for s in (0, 10, 20):
            m.save(s, _items(s))
        m.wait_until_mirrored(timeout=WAIT_S)
    assert sorted(p.name for p in (tmp_path / "vm1").glob("step_*")) == ["step_20"]
    before = _objects(fs, root)
    # a new VM restores step 10 from the bucket and trains forward
    with TieredCheckpointManager(tmp_path / "vm2", _store(s3, prefix),
                                 CheckpointManagerOptions(max_to_keep=1),
                                 mirror_max_to_keep=None) as m:
        r = m.restore(10)
        assert tree_equal(dict(r), _items(10))
        for force in (False, True):
            with pytest.raises(StepAlreadyExistsError, match="never replaces"):
                m.save(20, _items(-20), force=force)
        assert not (tmp_path / "vm2" / "step_20").exists()
        assert m.save(30, _items(30))
        m.wait_until_mirrored(timeout=WAIT_S)
    after = _objects(fs, root)
    assert {k: v for k, v in after.items() if "/step_30/" not in k} == before


@pytest.mark.timeout(120)
def test_opening_while_the_store_refuses_connections_resumes_then_catches_up(tmp_path, s3):
    from minickpt import CheckpointManager

    prefix, local = _prefix(), tmp_path / "local"
    with CheckpointManager(local) as c:  # the steps a restart finds on its disk
        for s in (0, 1):
            c.save(s, _items(s))
    port = _free_port()  # nothing listens there yet: connections are refused
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = TieredCheckpointManager(local, _store(f"http://127.0.0.1:{port}", prefix), OPTS,
                                    backoff_s=0.05, max_backoff_s=0.2)
    try:
        said = [str(w.message) for w in caught if "did not answer" in str(w.message)]
        assert said and "EndpointConnectionError" in said[0] and "[0, 1]" in said[0], said
        r = m.restore()  # resumed from the local disk
        assert r.step == 1 and tree_equal(dict(r), _items(1))
        assert m.save(2, _items(2))
        with pytest.raises(TimeoutError, match="has not answered"):
            m.wait_until_mirrored(timeout=0.5)
        with pytest.raises(MirrorError, match="has not answered since"):
            m.restore(7)  # a step the mirror alone might hold: not a CheckpointNotFoundError
        # a manager closed during the outage says what it kept
        with pytest.warns(UserWarning, match="did not answer"):
            other = TieredCheckpointManager(
                tmp_path / "other", _store(f"http://127.0.0.1:{port}", _prefix()), OPTS)
        other.save(0, _items(0))
        with pytest.raises(MirrorError, match=r"did not answer.*\[0\] are kept"):
            other.close()
        p = FaultProxy(s3, port=port)  # the store answers again
        try:
            m.wait_until_mirrored(timeout=WAIT_S)
            assert m.mirror_steps() == [0, 1, 2]
            m.close()
        finally:
            p.close()
    finally:
        with contextlib.suppress(MirrorError):
            m.close()
    steps, r = _restore_on_a_new_machine(tmp_path, _store(s3, prefix))
    assert steps == [0, 1, 2] and tree_equal(dict(r), _items(2))


@pytest.mark.timeout(120)
def test_verify_tells_an_upload_in_flight_from_one_cut_short(tmp_path, s3, monkeypatch,
                                                             capsys):
    from minickpt.cli import main

    prefix = _prefix()
    url, root = f"s3://{BUCKET}/{prefix}", f"{BUCKET}/{prefix}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3)
    store = PausingStore(url, 1, **_options(s3))
    fs = _fs(s3)
    try:
        with TieredCheckpointManager(tmp_path / "trainer", store, OPTS) as t:
            t.save(0, _items(0))
            t.wait_until_mirrored(timeout=WAIT_S)
            t.save(1, _items(1))
            assert store.reached.wait(WAIT_S)  # step 1 uploaded, not yet committed
            assert main(["verify", url]) == 0  # a live writer's upload: not damage
            out = capsys.readouterr().out
            assert "IN FLIGHT" in out and t.writer.id in out, out
            # the same folder, its writer gone (a process that has exited)
            marker = f"{root}/step_1/{UPLOAD_MARKER}"
            live = fs.cat_file(marker)
            rec = {**json.loads(live), "writer": "0" * 32, "pid": _dead_pid()}
            fs.pipe_file(marker, json.dumps(rec).encode())
            assert main(["verify", url]) == 1  # cut short: no live writer
            assert "UNCOMMITTED" in capsys.readouterr().out
            fs.pipe_file(marker, live)
            store.go.set()
            t.wait_until_mirrored(timeout=WAIT_S)
    finally:
        store.go.set()
    assert main(["verify", url]) == 0


def _dead_pid():
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=60)
    return p.pid


@pytest.mark.timeout(120)
def test_cleanup_aborts_the_multipart_uploads_a_killed_writer_left(tmp_path, s3):
    fs, prefix = _fs(s3), _prefix()

    def uploads():
        out = fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix=f"{prefix}/")
        return sorted(u["Key"] for u in out.get("Uploads") or [])

    for key in (f"{prefix}/step_3/params/data.bin", f"{prefix}/tensorboard/events.1"):
        mpu = fs.call_s3("create_multipart_upload", Bucket=BUCKET, Key=key)
        fs.call_s3("upload_part", Bucket=BUCKET, Key=key, UploadId=mpu["UploadId"],
                   PartNumber=1, Body=b"x" * (5 << 20))
    assert len(uploads()) == 2
    cm = _quiet()
    try:
        with TieredCheckpointManager(tmp_path / "local", _store(s3, prefix), OPTS) as m:
            assert m.mirror_steps() == []
    finally:
        cm.__exit__(None, None, None)
    assert uploads() == [f"{prefix}/tensorboard/events.1"]  # not a step folder: not ours


@pytest.mark.timeout(120)
def test_the_copy_queue_skips_steps_retention_already_retired(tmp_path, s3):
    prefix = _prefix()
    store = PausingStore(f"s3://{BUCKET}/{prefix}", 0, **_options(s3))
    events = []
    try:
        with TieredCheckpointManager(tmp_path / "local", store,
                                     CheckpointManagerOptions(max_to_keep=2)) as m:
            m.listeners.append(lambda ev, rec: events.append(rec) if ev == "mirror" else None)
            m.save(0, _items(0))
            assert store.reached.wait(WAIT_S)  # uploads slower than saves: a backlog
            for s in range(1, 6):
                m.save(s, _items(s))
            store.go.set()
            m.wait_until_mirrored(timeout=WAIT_S)
            assert m.mirrored == [0, 4, 5] and m.mirror_steps() == [4, 5]
    finally:
        store.go.set()
    skipped = sorted(e["step"] for e in events if e.get("skipped"))
    assert skipped == [1, 2, 3], events
    assert all("retired" in e["note"] for e in events if e.get("skipped"))


RACER_SCRIPT = """
import json, shutil, sys, time
import numpy as np
from minickpt import CheckpointManagerOptions
from minickpt.production.mirror import FsspecStore, LeaseHeldError
from minickpt.production.tiered import TieredCheckpointManager
url, opts, local, tag = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
shutil.rmtree(local, ignore_errors=True)  # a new VM: an empty local disk
store = FsspecStore(url, **opts)
while True:  # the replacement VM waits for the preempted one's lease
    try:
        m = TieredCheckpointManager(local, store, CheckpointManagerOptions(max_to_keep=2),
                                    mirror_max_to_keep=None, backoff_s=0.05)
        break
    except LeaseHeldError:
        time.sleep(0.1)
start = (m.latest_step() if m.latest_step() is not None else -1) + 1
print(json.dumps({"writer": m.writer.id, "tag": tag, "start": start}), flush=True)
for s in range(start, start + 10000):
    m.save(s, {"x": {"w": np.full(1 << 16, tag * 100000 + s, np.float32)}})
    time.sleep(0.02)
"""


def _racer(tmp_path, s3, prefix, tag):
    """A trainer process on ``prefix``; a thread collects the lines it prints."""
    env = {**os.environ, **FAKE_AWS_ENV, "JAX_PLATFORMS": "cpu"}
    p = subprocess.Popen(
        [sys.executable, "-c", RACER_SCRIPT, f"s3://{BUCKET}/{prefix}",
         json.dumps(_options(s3, client_retries=True)), str(tmp_path / f"vm{tag}"), str(tag)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    p.lines = []
    threading.Thread(target=lambda: p.lines.extend(p.stdout), daemon=True).start()
    return p


@pytest.mark.timeout(180)
def test_two_writers_racing_for_a_prefix_with_sigkills_during_uploads(tmp_path, s3):
    """Two trainers always alive on one prefix (a preempted VM and its replacement), the
    lease's holder SIGKILLed in the middle of its uploads, a new racer started each time:
    every committed step verifies and holds the values of the writer its commit names,
    and no committed step ever changes owner."""
    import random
    import signal

    from minickpt.production.mirror import _OWNER_LINE

    rng = random.Random(49)
    prefix, fs = _prefix(), _fs(s3)
    root = f"{BUCKET}/{prefix}"
    kills = int(os.environ.get("MINICKPT_S3_KILLS", "4"))
    racers = [_racer(tmp_path, s3, prefix, t) for t in (1, 2)]
    tags, owners, cut = {}, {}, 0  # writer id -> tag; step -> writer id seen committed
    store = _store(s3, prefix)

    def committed_owners():
        out = {}
        for name in store.listdir(""):
            if name.startswith("step_") and store.committed(name):
                out[int(name[5:])] = store.owner(name)["writer"]
        return out

    try:
        next_tag = 3
        for _ in range(kills):
            deadline = time.monotonic() + 60
            holder = None
            while holder is None and time.monotonic() < deadline:
                for p in racers:
                    if p.lines and p.poll() is None:
                        holder = p
                time.sleep(0.05)
            assert holder is not None, "no racer took the lease within 60 s"
            rec = json.loads(holder.lines[0])
            tags[rec["writer"]] = rec["tag"]
            time.sleep(rng.uniform(0.8, 2.0))  # saves and uploads under way
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=30)
            now = committed_owners()
            cut += any(store.exists(n) and not store.committed(n)
                       for n in store.listdir("") if n.startswith("step_"))
            for s, w in owners.items():  # a committed step is never replaced nor removed
                assert now.get(s) == w, (s, w, now.get(s))
            owners = now
            racers = [p for p in racers if p is not holder]
            racers.append(_racer(tmp_path, s3, prefix, next_tag))
            next_tag += 1
    finally:
        for p in racers:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    for p in racers:  # the last racers may have held the lease too
        for line in p.lines[:1]:
            rec = json.loads(line)
            tags[rec["writer"]] = rec["tag"]
    # the next writer cleans up what the killed ones left; a reader checks every step
    with TieredCheckpointManager(tmp_path / "final", _store(s3, prefix), OPTS):
        pass
    final = committed_owners()
    assert set(owners) <= set(final) and all(final[s] == w for s, w in owners.items())
    names = [n for n in store.listdir("") if n.startswith("step_")]
    assert all(store.committed(n) for n in names), names  # nothing half-written is left
    assert len(final) >= kills, final
    ro = CheckpointManagerOptions(read_only=True)
    with TieredCheckpointManager(tmp_path / "reader", _store(s3, prefix), ro) as reader:
        for s, w in sorted(final.items()):
            assert store.verify(f"step_{s}") == [], s
            assert w in tags, (s, w)  # written by one of the racers ...
            r = reader.restore(s)  # ... and holding that racer's values
            assert float(r["x"]["w"][0]) == tags[w] * 100000 + s, (s, w, tags[w])
    text = fs.cat_file(f"{root}/step_{min(final)}/{COMMIT_SUCCESS_FILE}").decode()
    assert _OWNER_LINE in text
    print(f"\nkill loop: {kills} SIGKILLs, {len(final)} committed steps, {cut} kills left an "
          f"upload cut short, writers {sorted(set(tags.values()))}")
