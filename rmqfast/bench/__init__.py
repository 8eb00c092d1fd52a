"""The benchmarks: direct vs HAProxy vs rmqfast, side by side, in one run.

``python -m rmqfast.bench [--short]`` (also ``rmqfast bench``, ``make bench``); ``--real`` and
``--clouds`` pick the modes that run the Java producer against real RocketMQ clusters.

What runs
---------
* ``bench/nullbroker.c``: a broker that stores nothing and answers every send, pull and
  heartbeat at once, as a broker would.  It is the ceiling ("direct") and the upstream of the
  proxies.
* ``bench/loadgen.c``: Java-shaped SEND_MESSAGE_V2 (and PULL_MESSAGE) traffic over many
  connections, closed loop (N requests in flight per connection) or open loop (fixed rate,
  latency from the scheduled send time).  It prints one JSON object per run.
* Targets: ``direct`` (loadgen -> nullbroker), ``haproxy`` (``mode tcp``, nbthread 2; full
  mode also ``haproxy-1t``, nbthread 1), ``rmqfast`` (``rmqfast serve``, 2 workers, one static
  broker endpoint, compiled scanner; full mode also ``rmqfast-1w``, 1 worker; on request
  ``rmqfast-syscalls``, ``RMQFAST_URING=0``), ``rmqfast-pure`` (same with
  ``RMQFAST_NO_EXTENSIONS=1``) and, in full mode, ``relay-floor`` (``bench/relayfloor.c``: a
  bare relay, one thread, epoll, a plain read and write per readable socket, no parsing; what
  one more user-space hop costs on this machine, with nothing else done).

The three C tools are compiled with ``gcc -O2`` into ``build/bench/`` on first use (the binary
name carries a hash of the sources and flags, so an edit rebuilds).  HAProxy is Debian's
package, installed with apt-get when missing (``--no-install`` to skip that target instead).

Method: every target is started once and stays up.  Each round runs every scenario against
every target, the target order rotating from one scenario and round to the next, with a
warm-up before each measured window and a pause until the target is idle again after it.
Medians over rounds are reported, with ratios and the issue's targets.  CPU time of the
target's processes (from /proc) is recorded per run, as CPU cores used and CPU microseconds
per request, because on a 2-core machine the load generator, the null broker and the proxy
share the same cores: a proxy that needs less CPU per message leaves more for the rest.

Results: one JSON object per line in ``results/bench/bench-<time>-<commit>.jsonl``:
``kind`` = ``run`` (one loadgen run), ``rss`` (per worker after the run), ``summary``
(medians per scenario and target) and ``check`` (one issue target, met or not).  Every line
carries ``run_id`` and ``machine`` (cpu model, cores, kernel, python and tool versions, git
commit), so a Spark job can read the folder as is.

Modules (each imports only those above it in this list, never this package's ``__init__``):

* :mod:`~rmqfast.bench.common`: paths, the results schema, :class:`BenchError`.
* :mod:`~rmqfast.bench.procfs`: CPU and memory of processes and of the machine, from /proc.
* :mod:`~rmqfast.bench.processes`: ports and stopping the processes the bench starts.
* :mod:`~rmqfast.bench.cbuild`: compiling ``bench/loadgen.c``, ``bench/nullbroker.c`` and
  ``bench/relayfloor.c``.
* :mod:`~rmqfast.bench.nullbroker`: the null broker process.
* :mod:`~rmqfast.bench.scenarios`: scenarios and the short/full modes.
* :mod:`~rmqfast.bench.loadgen`: one load generator run, with CPU accounting.
* :mod:`~rmqfast.bench.haproxy`: HAProxy (install, config, process).
* :mod:`~rmqfast.bench.targets`: the target protocol, ``direct`` and the rmqfast proxies.
* :mod:`~rmqfast.bench.floor`: the ``relay-floor`` target.
* :mod:`~rmqfast.bench.machine`: what the results say about the machine.
* :mod:`~rmqfast.bench.report`: medians, the issue's targets, the table.
* :mod:`~rmqfast.bench.run`: the null-broker bench (rounds x scenarios x targets).
* :mod:`~rmqfast.bench.javarun`: what the Java-producer modes share; :mod:`~rmqfast.bench.real`
  (``--real``) and :mod:`~rmqfast.bench.clouds` (``--clouds``) are those modes.
* :mod:`~rmqfast.bench.hostile_attack` (one attacker process: idle, exhaust, slowloris, HTTP
  slowloris, gRPC half-preface, admin flood), :mod:`~rmqfast.bench.hostile_probe` (the listener
  prober process), :mod:`~rmqfast.bench.hostile_report` (silences, health truth, RSS budget,
  goals) and :mod:`~rmqfast.bench.hostile` (``--hostile``: the run).
* :mod:`~rmqfast.bench.cli`: the command line (``main``), which picks the mode.
"""
