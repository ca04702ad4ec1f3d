"""Old import path of the tf.distribute transport, kept for one release: import ``distmem.comm.tf_strategy`` instead."""
from .comm.tf_strategy import *  # noqa: F401,F403
from .comm.tf_strategy import __all__  # noqa: F401
