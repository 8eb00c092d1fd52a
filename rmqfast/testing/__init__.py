"""Real-RocketMQ test harness for rmqfast (stdlib only; needs Java 17+ and Maven at run time).

* :mod:`rmqfast.testing.cluster` builds the Java side once (``ensure_jars``: Apache RocketMQ name
  server + broker + tools from Maven Central, and the ``RmqDriver`` traffic generator compiled
  against rocketmq-client 5.x and 4.9.4) and runs a throw-away single-broker cluster on loopback
  ports (``RocketMQCluster``). It also has a tiny JSON Remoting client (``remoting_request``) used
  for readiness checks and topic creation straight against the broker/name server.
* :mod:`rmqfast.testing.javaclient` runs the driver (``run_driver`` / ``start_driver``) with the
  real Java clients against any name server address: the real one, or an rmqfast proxy's.

Nothing here imports the proxy: these tools talk to real RocketMQ, which is what makes them a
reference for the proxy's tests.
"""

from rmqfast.testing.cluster import (
    ROCKETMQ4_VERSION,
    ROCKETMQ_VERSION,
    ClusterError,
    HarnessError,
    JarPaths,
    MavenBuildError,
    RemotingResponse,
    RocketMQCluster,
    ToolMissingError,
    ensure_jars,
    remoting_request,
)
from rmqfast.testing.javaclient import (
    CLIENT_VERSIONS,
    DriverError,
    DriverProcess,
    driver_command,
    run_driver,
    start_driver,
)

__all__ = [
    "CLIENT_VERSIONS",
    "ROCKETMQ4_VERSION",
    "ROCKETMQ_VERSION",
    "ClusterError",
    "DriverError",
    "DriverProcess",
    "HarnessError",
    "JarPaths",
    "MavenBuildError",
    "RemotingResponse",
    "RocketMQCluster",
    "ToolMissingError",
    "driver_command",
    "ensure_jars",
    "remoting_request",
    "run_driver",
    "start_driver",
]
