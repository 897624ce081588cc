"""``torchrun ... -m syncwise.train [--config FILE] [--section.key=value ...]``: one worker of a job.

An alias of ``-m syncwise.commands.worker``, kept so that existing torchrun command lines keep working.
This file is a program entry point, not library code: nothing imports it (tests/test_layers.py checks),
which is why it alone under ``syncwise/train`` may reach the command layer (docs/architecture.md).
"""
import sys

from syncwise.commands.worker import main

if __name__ == "__main__":
    sys.exit(main())
