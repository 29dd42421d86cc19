"""Multi-host checkpoints: every process of a ``jax.distributed`` job saves one checkpoint.

The same :class:`~minickpt.manager.CheckpointManager` code runs on one process and on many.
With several processes a save is a small collective protocol (chapter 4, lab 4):

1. **Agree** (Task 4.1). Every process publishes the step, the item names and a checksum
   of its trees' structure; they must all be equal, else every process raises
   :class:`~minickpt.errors.ProcessDisagreementError` naming who said what.
2. **Snapshot.** Each process copies to host memory the shards it *owns* (Task 4.2): of the
   devices holding the same piece of an array, the first in the sharding's device order
   (``replica_id == 0``). Every piece is thus written exactly once, however replicated it
   is. Values that are not sharded across processes (numbers, numpy arrays, fully
   replicated arrays) are written by the primary process alone.
3. **Write, then commit** (Task 4.3). The primary creates the temporary directory —
   barrier — every process writes and fsyncs its shard files — barrier — the primary
   writes the manifests and the metadata and commits (fsync, rename, fsync of the parent)
   — barrier. The rename is the only publication: a reader never sees a checkpoint whose
   shards are incomplete, and nobody returns from ``save`` before the commit is durable.
4. **Restore onto any sharding** (Task 4.4). Each process reads only the regions its
   devices need (``jax.make_array_from_callback`` over the saved shard files), so a
   checkpoint saved on 4 processes restores on 2, on 1, or on another mesh.

Every barrier has a time-out (``MultiHostOptions.timeout_s``). When a process dies or
hangs, the others raise :class:`~minickpt.errors.PeerTimeoutError` naming the missing
processes; the primary removes the temporary directory, so no step is committed. Barriers
go through the coordination service's key-value store and ``wait_at_barrier`` (the only
JAX primitives with a time-out); XLA collectives (``multihost_utils``) have none and hang
on a dead or hung peer, so minickpt never uses them: even the bytes of a ``primary_only``
restore travel through the key-value store (in chunks), bounded by the same time-out.

What JAX itself does on failure, and what to do about it:

* After a :class:`PeerTimeoutError`, leave with :func:`hard_exit`: a normal exit runs
  ``jax.distributed.shutdown()``, a barrier the dead peer never reaches (it waits
  ``shutdown_timeout_seconds``, then aborts).
* If a process *dies*, the JAX runtime aborts every survivor ``heartbeat_timeout_seconds``
  later (100 s by default). Keep ``timeout_s`` well below it so survivors fail with a
  Python error first.
* If process 0 (it hosts the coordination service, and is the primary by default) dies,
  a survivor whose call fails first raises :class:`PeerTimeoutError` naming process 0 as
  unreachable; within about a second JAX's client aborts every survivor from C++ anyway
  (see :mod:`minickpt.multihost.coordinator` for why Python cannot stop it). A temporary
  directory stays behind; the next primary to open the manager removes it.

**Replicated state, the Flax way.** With ``MultiHostOptions(primary_only=True)`` the
primary alone writes (every leaf must be replicated: data parallelism), and on restore the
primary alone reads and *broadcasts* to the others (through the coordination service, in
1 MiB chunks: the state passes through process 0's memory, and must be sent within
``timeout_s``). Use it when the state is replicated
and you want the other hosts to stay off the storage (one reader instead of N). Use the
default, sharded protocol whenever the state is sharded (FSDP, tensor parallelism): each
host then writes and reads only its part, and no host needs memory for the whole state.

**Async** (chapter 5). The protocol's write phase (:meth:`CollectiveSave.run`) is a plain
callable, safe to run in a background thread: barriers and the key-value store may be used
from any thread. ``CheckpointManager(..., enable_async_checkpointing=True)`` does so: the
agreement and the snapshot (a real copy) happen in ``save()``, the rest in the background,
and every process waits for its save in flight before its next collective operation, so
operations run in the same order everywhere and their barrier ids never collide.

This package touches one private JAX object, the coordination-service client; everything
that does lives in :class:`minickpt.multihost.process.Coordination`.

The multi-host code has one module per concept, and every import names the module where the
code lives (``from minickpt.multihost.sync import agree_on_step``). Read them in this order:

* :mod:`minickpt.multihost.process` — joining a job, leaving it, fault injection, JAX's coordinator
* :mod:`minickpt.multihost.sync` — exchanges at barriers with time-outs; step agreement (4.1)
* :mod:`minickpt.multihost.ownership` — which shards a process writes (4.2); one process's snapshot
* :mod:`minickpt.multihost.save` — the collective save: agree, snapshot, two-barrier commit (4.3)
* :mod:`minickpt.multihost.broadcast` — replicated state: the primary reads, the others receive
* :mod:`minickpt.format.regions` — restoring onto another mesh: reading only the regions needed (4.4)
"""
