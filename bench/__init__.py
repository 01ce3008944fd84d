"""termpool's benchmark harness (issue 4): see bench/README.md. Run it with `python -m bench.run`."""
