"""The Alertmanager webhook receiver test_alert_delivery runs on the monitoring host, and the parsers of what it
records: no pytest, no test host, so tests/unit/test_alertmanager.py dry-runs the same receiver and parsers on
127.0.0.1 (imported as ansible_collections.b300.pd.tests.integration.alert_webhook).
"""

from __future__ import annotations

import re
from datetime import datetime

# The webhook receiver run on the monitoring host (python3 stdlib): appends every JSON body POSTed to the path to
# the output file, one line each; prints "listening <port>" once bound (tests/unit/test_alertmanager.py runs it).
RECEIVER = """
import http.server, json, sys
out, host, port, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path != path:
            self.send_response(404)
        else:
            try:
                payload = json.loads(body)
            except ValueError:
                self.send_response(400)
            else:
                with open(out, "a") as f:
                    f.write(json.dumps(payload) + "\\n")
                self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer((host, port), Handler)
print("listening", server.server_address[1], flush=True)
server.serve_forever()
"""


def duration_s(text: str) -> float:
    """Prometheus/Alertmanager duration ("1m30s", "15s", "500ms") in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|[smhdwy])", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(int(n) * units[u] for n, u in parts)


def timestamp(text: str) -> float:
    """RFC 3339 time as Alertmanager writes it (nanoseconds, Z) -> epoch seconds."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", text)
    assert m, f"not an RFC 3339 time: {text!r}"
    frac = (m.group(2) or "0")[:6].ljust(6, "0")
    tz = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(f"{m.group(1)}.{frac}{tz}").timestamp()


def matching(notifications: list[dict], status: str, labels: dict, since: float) -> list[dict]:
    """Alerts of the webhook bodies with this status and these labels, started (firing) / ended (resolved) since."""
    out = []
    for body in notifications:
        for alert in body.get("alerts", []):
            if alert.get("status") != status or any(alert["labels"].get(k) != v for k, v in labels.items()):
                continue
            when = alert["startsAt"] if status == "firing" else alert["endsAt"]
            if timestamp(when) >= since:
                out.append(alert)
    return out
