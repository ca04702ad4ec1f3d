"""Fixtures of the native-cap tests: everything built once into a temp directory; for the security
tests a world-readable copy of the programs, a simulated shared node and real Unix users."""
import os
import shutil
import tempfile

import pytest

from native_helpers import Built, build_all
from unix_users import Node, Users, require_root


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Built:
    return build_all(tmp_path_factory.mktemp("native"))


@pytest.fixture(scope="session")
def public(built):
    """The library, the fake driver, capdrv and capattack where every user can run them."""
    d = tempfile.mkdtemp(prefix="distmem-native-pub-", dir="/tmp")
    os.chmod(d, 0o755)
    for src in (built.lib, os.path.join(built.fake_dir, "libcuda.so.1"), built.capdrv, built.capattack):
        dst = os.path.join(d, os.path.basename(src))
        shutil.copy2(src, dst)
        os.chmod(dst, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def node(public):
    n = Node(public)
    yield n
    n.close()


@pytest.fixture
def users():
    require_root()
    u = Users()
    try:
        yield u
    finally:
        u.close()
