"""The example task: a workspace whose ``app.py`` prints the wrong greeting, the task file
that describes it (``task.yaml``) and an agent that fixes it (``agent.py``).

The folder is a Python package so that a worker can import the agent as
``greeting.agent:make_agent`` once the folder's parent is on ``PYTHONPATH`` and
``RATCHET_AGENTS=greeting`` allows it. See ``examples/README.md``.
"""
