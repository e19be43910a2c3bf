"""What every part of a fleet shares, worker processes and operator commands alike: the
settings (:mod:`.settings`), the connected fleet (:mod:`.context`: the store, the queue,
the key ring and trust roots), run documents (:mod:`.runs`), the store's clock
(:mod:`.clock`), sealed control requests (:mod:`.control`: posted by operators, applied by
workers), logging, metrics, scrubbing of secrets, and worker identities."""

__all__: list[str] = []
