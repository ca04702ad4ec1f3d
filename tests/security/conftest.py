"""The cross-user suite: every test here runs steps as two real Unix users made for it (see
crossuser.py); skipped, with the reason, where they cannot be made (not root)."""
import pytest

from crossuser import Users, unavailable


@pytest.fixture(scope="module")
def users():
    why = unavailable()
    if why:
        pytest.skip(why)
    made = Users()
    try:
        yield made
    finally:
        made.remove()
