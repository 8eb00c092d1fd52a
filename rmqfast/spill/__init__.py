"""The per-worker durable spill of cross-cloud copies (RocksDB through rocksdict)."""

from rmqfast.spill.commit import GroupCommitter
from rmqfast.spill.record import ORIGIN_PROPERTY, CopyRecord
from rmqfast.spill.store import SpillError, SpillStore, worker_dir

__all__ = ["ORIGIN_PROPERTY", "CopyRecord", "GroupCommitter", "SpillError", "SpillStore", "worker_dir"]
