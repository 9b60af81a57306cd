"""The cache: where a request's entries live and how they move.

    index       the device index of entries (`SegmentCache`): content-addressed keys, a byte budget, pins
    pools       the fixed device pools that hold every entry's pieces, by slot and row
    tiers       the tiers below the pools (other devices, host memory, disk), their copies, cost model and policy
    hierarchy   one engine's entries across the pools and the tiers: promotion, demotion, persistence, stats
"""
