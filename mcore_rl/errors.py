"""Errors that say how a run ends, shared by every layer (tests/test_layers.py puts this module at the bottom).

ProcessDied    a process the run cannot go on without died (an actor rank, the router): exit 1 with one line
               naming it (mcore_rl/lifecycle.py), no traceback; the cause of the first error it left is chained
"""

from __future__ import annotations


class ProcessDied(RuntimeError):
    """A process of the run died under it (kill -9, the OOM killer, a crash): the message names which, and how."""
