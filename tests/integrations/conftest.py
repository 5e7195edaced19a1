"""Fixtures of the framework tests."""

import pytest

from framework_helpers import reset_accelerate_state


@pytest.fixture
def fresh_accelerate_state():
    """A test that builds an Accelerator (or a Hugging Face Trainer) runs between two resets of
    accelerate's process-wide state."""
    reset_accelerate_state()
    yield
    reset_accelerate_state()
