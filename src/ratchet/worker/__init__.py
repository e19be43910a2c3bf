"""The worker's RQ shell: the executor (the one place an effect happens), the RQ job, the
pool of worker processes, the lease heartbeat, the reaper and the hooks a drill or a test
may attach. What it shares with operator commands is :mod:`ratchet.fleet`; operator
operations are :mod:`ratchet.ops`, which this package does not import."""

__all__: list[str] = []
