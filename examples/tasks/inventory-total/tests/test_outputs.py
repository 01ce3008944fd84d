import json
import urllib.request
from pathlib import Path

TOTAL = Path("/app/total.txt")


def inventory_total() -> int:
    with urllib.request.urlopen("http://inventory:8000/items", timeout=10) as reply:
        return sum(item["quantity"] for item in json.load(reply))


def test_total_file_exists():
    assert TOTAL.is_file(), f"{TOTAL} does not exist"


def test_total_matches_the_inventory():
    assert TOTAL.read_text().strip() == str(inventory_total())
