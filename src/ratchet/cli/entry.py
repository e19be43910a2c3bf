"""``python -m ratchet.cli.entry``: the same as the ``ratchet`` console script."""

from ratchet.cli import main

if __name__ == "__main__":
    main()
