"""Cache tiers below the device pools: other devices' memory, host memory, then disk.

An entry evicted from the device pools is demoted: its slot's pieces and its token rows are copied to the host in
one buffer (`Mover.gather_start`, `Mover.gather_finish`) and kept in the peer tier (that buffer moved to the memory
of one of the engine's other devices, `PeerStore`) or the host tier; the peer tier's evictions go to the host tier,
the host tier's to disk, one file per entry. A hit in a lower tier promotes the entry back into the pools: its
buffer goes to the device in one transfer, issued while the request plans, and is written into the pools after the
request's cold prefill was issued, so the copy overlaps with it (`Mover.transfer`, `Mover.scatter_programs`). The
copies are compiled programs, one pair per bucket of whole pages (powers of two up to the longest entry), so no
entry size compiles anything after warmup.

Peer and host tiers: exclusive (a promoted entry leaves them). Disk tier: inclusive (a promoted entry's file stays,
so a restarted process finds it; demoting an entry whose file exists writes nothing).

Modules, one job each:

    pieces   an entry off the device (`Pieces`), its raw bytes and payload checksums
    cost     the recompute cost model, the tiers' bandwidths and the eviction policy
    copies   the compiled copies between the pools and the tiers (`Mover`, `Staged`, `Transfer`)
    store    what every tier's store shares: a byte budget ranked by the policy
    host     the host tier (`HostStore`)
    peer     the peer tier (`PeerStore`)
    disk     the disk tier and its file format (`DiskStore`)
    chain    the tiers together (`Tiers`): where a demoted entry goes, where a missing one is found

The names below are this package's public ones, re-exported here.
"""

from hypic_jax.cache.tiers.chain import Tiers
from hypic_jax.cache.tiers.copies import DROP, HOST_MEMORY, Mover, Staged, Transfer, compact_form, dense_transfer_leaves
from hypic_jax.cache.tiers.cost import (DEFAULT_COST, DEFAULT_DISK_BANDWIDTH, DEFAULT_HOST_BANDWIDTH,
                                        DEFAULT_PEER_BANDWIDTH, TIERS, Bandwidths, CostModel, DevicePolicy, Policy)
from hypic_jax.cache.tiers.disk import FORMAT_VERSION, MAGIC, SUFFIX, DiskStore
from hypic_jax.cache.tiers.host import HostStore
from hypic_jax.cache.tiers.peer import PeerStore
from hypic_jax.cache.tiers.pieces import DIGEST_SLICE, Pieces, payload_digests, raw_bytes
from hypic_jax.cache.tiers.store import TierStats

__all__ = ["Bandwidths", "CostModel", "DevicePolicy", "DiskStore", "HostStore", "Mover", "PeerStore", "Pieces",
           "Policy", "Staged", "Tiers", "TierStats", "Transfer", "FORMAT_VERSION", "MAGIC", "SUFFIX", "DIGEST_SLICE",
           "DROP", "HOST_MEMORY", "TIERS", "DEFAULT_COST", "DEFAULT_HOST_BANDWIDTH", "DEFAULT_DISK_BANDWIDTH",
           "DEFAULT_PEER_BANDWIDTH", "compact_form", "dense_transfer_leaves", "payload_digests", "raw_bytes"]
