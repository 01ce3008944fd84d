"""Chaos suite: whole episodes through the pool API while one fault hits the service (a
process killed or stopped, Redis restarted or cut off, the whole stack crashed and relaunched,
the CPU saturated); see chaos/run.py."""
