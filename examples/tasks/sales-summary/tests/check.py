"""One point per right field of /app/summary.json; `reward` is their mean."""

import json

expected = {"count": 7, "total": 585, "top_region": "east"}
try:
    with open("/app/summary.json") as fh:
        answer = json.load(fh)
except (OSError, ValueError):
    answer = {}
if not isinstance(answer, dict):
    answer = {}
points = {key: float(answer.get(key) == value) for key, value in expected.items()}
print(json.dumps({"reward": sum(points.values()) / len(points), **points}))
