"""The inventory sidecar: GET /items -> a JSON list of items.

Quantities are drawn at random when the service starts, so the answer differs from run to
run and can only come from asking this service (the tests ask it too).
"""

import json
import random
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NAMES = ["bolt", "nut", "washer", "gear", "spring", "hinge", "bracket"]
ITEMS = [
    {"sku": f"A-{i + 1}", "name": name, "quantity": random.randint(0, 50)}
    for i, name in enumerate(random.sample(NAMES, 5))
]


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.rstrip("/") != "/items":
            self.send_error(404, "try GET /items")
            return
        body = json.dumps(ITEMS).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet container log
        pass


ThreadingHTTPServer(("0.0.0.0", 8000), Handler).serve_forever()
