"""Per-stream KV storage: sinks + ring window, dense or quantized, and a per-device pool."""

from kvcache.cache import StreamCache, make_storage
from kvcache.park import HostCopier, ParkBudget, ParkedCache, Transfer, park_cache, restore_cache
from kvcache.pool import CachePool, PoolFull, Reservation
from kvcache.spec import QUANT_MODES, CacheSpec
from kvcache.storage import DenseStorage, KVStorage
from kvcache.workspace import Workspace

__all__ = [
    "QUANT_MODES",
    "CachePool",
    "CacheSpec",
    "DenseStorage",
    "HostCopier",
    "KVStorage",
    "ParkBudget",
    "ParkedCache",
    "PoolFull",
    "Reservation",
    "StreamCache",
    "Transfer",
    "Workspace",
    "make_storage",
    "park_cache",
    "restore_cache",
]
