"""Errors that say how a run ends, shared by every layer (tests/test_layers.py puts this module at the bottom).

ProcessDied        a process the run cannot go on without died (an actor rank, the router): exit 1 with one line
                   naming it (mcore_rl/lifecycle.py), no traceback; the cause of the first error it left is chained
TrainingDiverged   the loss, grad norm or pushed weights stopped being finite: exit 1 with the message alone
Terminated         SIGTERM arrived: exit 143, FAILED naming where the run stopped
sigint_received()  whether a real Ctrl-C came (lifecycle's SIGINT handler sets SIGINT_SEEN): a KeyboardInterrupt
                   a reward raised itself is the reward's error, the user's Ctrl-C stops the run
"""

from __future__ import annotations

import threading

SIGINT_SEEN = threading.Event()  # a real Ctrl-C, as against a KeyboardInterrupt some code raised itself


class ProcessDied(RuntimeError):
    """A process of the run died under it (kill -9, the OOM killer, a crash): the message names which, and how."""


class Terminated(BaseException):
    """SIGTERM arrived (scancel, a scheduler's time limit, `kill`). A BaseException, as KeyboardInterrupt, so no
    `except Exception` on the way swallows it, and the run's `finally` blocks stop its engines and ranks."""


class TrainingDiverged(RuntimeError):
    """The loss or the grad norm stopped being finite for longer than trainer.max_nonfinite_steps allows (raised by
    metrics/logger.py), or the engines refused a push's weights as non-finite: exit 1 with this message alone, as the
    traceback would say nothing more."""


def sigint_received() -> bool:
    """Whether this process got a real Ctrl-C (SIGINT) since lifecycle.run_guarded started: a KeyboardInterrupt
    raised by other code (a reward function's) is that code's failure, not the user's interrupt."""
    return SIGINT_SEEN.is_set()
