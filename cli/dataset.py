"""`flask --app app dataset ...`: download, check, prebuild and oracle-run task datasets."""
from __future__ import annotations

import click
from flask.cli import AppGroup

dataset_cli = AppGroup("dataset", help="Work with terminal-bench task datasets.")
