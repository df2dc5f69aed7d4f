"""KV page bookkeeping: the page pool and the radix prefix cache (plain Python, no torch)."""

from mili_openai.radix.page_pool import OutOfPages, PagePool
from mili_openai.radix.snapshots import SnapshotStore
from mili_openai.radix.tree import InsertResult, PrefixMatch, RadixCache, RadixNode

__all__ = ["PagePool", "OutOfPages", "RadixCache", "RadixNode", "PrefixMatch", "InsertResult", "SnapshotStore"]
