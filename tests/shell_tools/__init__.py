"""The terminal tools (docs/tools.md) against real containers of the test base image.

Observation texts are compared exactly: the policy learned to read them. Every tool test runs
in both transports: one `docker exec` per call ("exec"), and the container's tp-session server
over a unix socket in a host directory mounted at CTL_DIR ("socket"; a call that falls back to
docker exec fails the test there).
"""
