"""Operator commands, run through Flask's CLI: `flask --app app dataset ...`."""
