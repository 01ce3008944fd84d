#!/bin/bash
# The grader: termpool runs this as root with TEST_DIR=/tests and reads pytest's
# "short test summary info" (-rA lists every test there); the reward is passed / total.
python3 -m pytest "${TEST_DIR:-/tests}/test_outputs.py" -rA
