"""Session fixture of the native-cap tests: everything built once into a temp directory."""
import pytest

from native_helpers import Built, build_all


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Built:
    return build_all(tmp_path_factory.mktemp("native"))
