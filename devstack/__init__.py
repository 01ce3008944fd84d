"""A development stack: termpool's processes started from this checkout for the tests, the
benchmark (bench/) and the chaos suite (chaos/). Not part of the client wheel nor of the image."""

from devstack.stack import FIXTURES, ROOT, WORKER_KINDS, Stack, free_port
from devstack.threads import at_once

__all__ = ["FIXTURES", "ROOT", "WORKER_KINDS", "Stack", "at_once", "free_port"]
