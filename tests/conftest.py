"""Test-session hygiene shared by every test module."""

from __future__ import annotations

import pytest

from families import trim_compiled_programs


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
    """After each test, keep the process under its memory-map limit (`families.trim_compiled_programs`: XLA's CPU
    compiler segfaults once a worker's compiled programs reach it)."""
    yield
    trim_compiled_programs()
