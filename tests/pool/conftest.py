"""Fixtures of the pool tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Page copies are small memcpys; on a loaded 2-core machine OpenMP's parallel copy waits for a
    # descheduled worker (milliseconds per 80 KB copy), so these tests run the copies single-threaded.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
