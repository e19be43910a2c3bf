"""The task's check: app.py prints the right greeting.

Runs under pytest (``python3 -m pytest -q test_app.py``) and as a plain script
(``python3 test_app.py``), so the verifier needs nothing but Python.
"""

import subprocess
import sys
from pathlib import Path


def test_app_prints_the_greeting() -> None:
    app = Path(__file__).with_name("app.py")
    out = subprocess.run(  # noqa: S603
        [sys.executable, str(app)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    if out.stdout != "Hello, world\n":
        raise AssertionError(f"unexpected greeting: {out.stdout!r}")


if __name__ == "__main__":
    test_app_prints_the_greeting()
    print("ok")
