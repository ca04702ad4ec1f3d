#!/usr/bin/env python3
"""Start N local tf.distribute workers, each with its own TF_CONFIG and a free port.

    python launch/tf_config.py -n 4 examples/tf_distribute.py --steps 5
    python launch/tf_config.py -n 2 --timeout 300 -- python -m mypackage.train

The same launcher as ``distmem launch-tf``: output prefixed with ``[rank i]``, the first failing
worker stops the others, a hard ``--timeout`` (exit 124), non-zero exit if any worker failed.
Runs from a clone without installing distmem.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distmem.cli.launch_tf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
