"""The lease logic on top of the Redis core (store/): requests checked, leases and the queue,
bookings, nodes and pools, idle reclaim, usage, the board's view, the background loops."""
