"""Real-RocketMQ test harness for rmqfast (needs Java 17+ and Maven at run time).

* :mod:`rmqfast.testing.maven` builds the Java side once (``ensure_jars``: Apache RocketMQ name
  server + broker + tools from Maven Central, and the ``RmqDriver`` traffic generator compiled
  against rocketmq-client 5.x and 4.9.4).
* :mod:`rmqfast.testing.cluster` runs a throw-away single-broker cluster on loopback ports
  (``RocketMQCluster``), its JVMs started by :mod:`rmqfast.testing.jvm` on ports leased from
  :mod:`rmqfast.testing.ports`.
* :mod:`rmqfast.testing.remoting` is a one-request Remoting client (``remoting_request``) over
  rmqfast's codec, for readiness checks and admin requests straight to the broker/name server.
* :mod:`rmqfast.testing.javaclient` runs the driver (``run_driver`` / ``start_driver``) with the
  real Java clients against any name server address: the real one, or an rmqfast proxy's.
* :mod:`rmqfast.testing.proxy` runs ``rmqfast serve`` as a subprocess (``ProxyProcess``).
* :mod:`rmqfast.testing.sparkcluster` runs a Spark standalone Master + Worker from the installed
  pyspark on loopback (``StandaloneCluster``), for the Spark report on a real cluster.
* ``python -m rmqfast.testing`` (:mod:`rmqfast.testing.__main__`) starts a cluster by hand.

Nothing here imports the proxy's runtime (only its codec, to frame admin requests): these
tools talk to real RocketMQ, which is what makes them a reference for the proxy's tests.
"""

from rmqfast.testing.cluster import RocketMQCluster
from rmqfast.testing.errors import ClusterError, HarnessError, MavenBuildError, ToolMissingError
from rmqfast.testing.javaclient import (
    CLIENT_VERSIONS,
    DriverError,
    DriverProcess,
    driver_command,
    run_driver,
    start_driver,
)
from rmqfast.testing.maven import ROCKETMQ4_VERSION, ROCKETMQ_VERSION, JarPaths, ensure_jars
from rmqfast.testing.remoting import RemotingResponse, remoting_request

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
