#!/bin/bash
set -e
python3 - <<'PY'
import json
import urllib.request

with urllib.request.urlopen("http://inventory:8000/items", timeout=10) as reply:
    items = json.load(reply)
with open("/app/total.txt", "w") as out:
    out.write(f"{sum(item['quantity'] for item in items)}\n")
PY
