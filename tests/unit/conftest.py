"""pytest fixtures of the unit tests; the helpers they share are in pd_testlib.py."""

from __future__ import annotations

import pytest
from ansible_collections.b300.pd.tests.unit.pd_testlib import load_inventory


@pytest.fixture
def b300():
    return load_inventory("b300")


@pytest.fixture
def local_inv():
    return load_inventory("local")
