"""A second KV-cache tier that evicted prefix blocks spill to and return from (issue 19).

``tier.py`` is the interface and the host-memory tier, ``disk_tier.py`` the local-disk tier that
survives restarts, ``offloader.py`` the asynchronous writer and reader with the load-or-recompute
cost rule, ``block_io.py`` the copies between the device pool and host tensors.
"""
