"""Workers: the RQ job, the executor loop, heartbeats, the reaper, failpoints and drills."""

__all__: list[str] = []
