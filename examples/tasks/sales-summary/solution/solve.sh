#!/bin/bash
# Harbor's oracle runs this from the container's working directory (/app).
python3 - <<'PY'
import csv
import json
from collections import Counter

with open("sales.csv") as fh:
    rows = list(csv.DictReader(fh))
by_region = Counter()
for row in rows:
    by_region[row["region"]] += int(row["amount"])
summary = {"count": len(rows), "total": sum(by_region.values()), "top_region": by_region.most_common(1)[0][0]}
with open("summary.json", "w") as fh:
    json.dump(summary, fh)
PY
