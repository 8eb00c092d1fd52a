"""The deliver process pool: separate processes that send copies to remote clouds.

Who reads the spill
-------------------
RocketMQ's own answer to "one writer" is RocksDB's: a database has exactly one writer process.
Three designs were weighed:

1. *Deliver processes open the workers' databases as secondary instances* (rocksdict
   ``AccessType.secondary``) and tell the worker what to delete.  A secondary sees new
   writes only after ``try_catch_up_with_primary`` (it replays the primary's WAL and
   MANIFEST; measured here: median 1.0 ms, p90 2.5 ms per call with 100 new 1 KiB copies
   between calls),
   so every hand-off costs a polling delay, deletes still need a channel back to the worker,
   and fast mode's in-memory copies (which are not in RocksDB at all) would need a second
   path anyway.
2. *The deliver process owns the database and workers send it copies.*  Then durable mode
   needs a round trip to another process before the producer's answer, and the per-worker,
   shared-nothing spill of the design becomes a shared one.
3. *The worker owns its database; it hands copies to a deliver process over a Unix socket
   and deletes what the deliver process acknowledges* (chosen).  One writer, one reader,
   both in the worker; the copy path costs one ``sendall`` of a small frame; the deliver
   process is stateless (a crash loses nothing: the worker resends everything unacknowledged
   when it reconnects) and does all the remote network work, retries and backoff, off the
   workers' event loops.  The ``rmqfast spill`` command uses the secondary mode (1) only to
   *read* a running proxy's backlog.

Ordering: a worker sends the copies of one (remote, topic) lane in sequence order and the
deliver process keeps per-queue FIFO lanes, so order per message queue holds end to end;
after a reconnect the worker resends from the oldest unacknowledged copy.
"""
