"""Chaos suite: whole episodes through the pool API while one process of the service is
killed (or Redis restarted); see chaos/run.py."""
