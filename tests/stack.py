"""The dev stack moved to devstack/ (bench/ and chaos/ use it too); this name stays for tests
written against it."""

from devstack import FIXTURES, ROOT, WORKER_KINDS, Stack, free_port

__all__ = ["FIXTURES", "ROOT", "WORKER_KINDS", "Stack", "free_port"]
