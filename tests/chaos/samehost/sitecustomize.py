"""A misconfigured fleet for the multi-host drill's test: every process claims one host
name (two machines given one ``RATCHET_HOST``), whatever its host's name is. Put first on
``PYTHONPATH`` for the drill, so every process it starts on every host loads it."""

import os

os.environ["RATCHET_HOST"] = "drill-host-1"
