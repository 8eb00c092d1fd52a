"""rmqfast: a high-throughput proxy for Apache RocketMQ's Remoting protocol."""

__version__ = "0.1.0"
