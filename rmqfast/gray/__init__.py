"""Gray (canary) releases inside one consumer group, with no change to clients or brokers.

* :mod:`rmqfast.gray.config`: the ``[gray]`` section.
* :mod:`rmqfast.gray.rules`: the decisions, as pure functions (who is gray, which queues are gray,
  which side may pull a queue, where a send goes, the switch-back phases).
* :mod:`rmqfast.gray.state`: promote/abort commands, shared by the workers through a small file.
* :mod:`rmqfast.filters.gray`: the broker-chain filter that carries the decisions out on frames.
"""
