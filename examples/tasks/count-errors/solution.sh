#!/bin/bash
# Count lines whose second field is ERROR (not lines that merely mention the word).
awk '$2 == "ERROR"' /app/server.log | wc -l > /app/errors.txt
