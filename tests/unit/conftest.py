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


@pytest.fixture(scope="session", autouse=True)
def _session_fact_cache(tmp_path_factory):
    """The unit tests' local plays keep their facts in a cache of this session, not the clone's .cache/facts (kept
    an hour, fact_caching_timeout): an interpreter one run discovered on its PATH (a pyenv shim that cannot run
    elsewhere) is never another run's. A test that sets ANSIBLE_CACHE_PLUGIN(_CONNECTION) itself keeps its own."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ANSIBLE_CACHE_PLUGIN_CONNECTION", str(tmp_path_factory.mktemp("ansible-facts")))
    yield
    mp.undo()
