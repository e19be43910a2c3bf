"""Run the reference orders API: ``python -m ratchet.chaos.orders_server --db PATH
[--host 127.0.0.1] [--port 8080]``. It prints ``listening on <url>`` once it serves."""

from ratchet.chaos.orders import main

__all__: list[str] = []

if __name__ == "__main__":
    main()
