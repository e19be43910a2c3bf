from __future__ import annotations

import pytest

from tests.runtime.world import World


@pytest.fixture
def world() -> World:
    return World()
