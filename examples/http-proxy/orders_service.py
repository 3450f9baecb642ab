"""A toy order service with no idempotency of its own: every POST /orders
creates an order (slowly, like a real one), numbered from 1.

    python3 orders_service.py 3000 [seconds per order]
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import time


class Orders:
    def __init__(self, seconds_per_order: float) -> None:
        self.lock = threading.Lock()
        self.created: list[dict] = []
        self.seconds_per_order = seconds_per_order


def handler_for(orders: Orders) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            length = int(self.headers.get("Content-Length", "0"))
            received = json.loads(self.rfile.read(length) or b"{}")
            time.sleep(orders.seconds_per_order)
            with orders.lock:
                orders.created.append(received)
                number = len(orders.created)
            body = json.dumps({"order": number, "received": received}).encode()
            self.send_response(201)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def serve(port: int, seconds_per_order: float) -> tuple[ThreadingHTTPServer, Orders]:
    """Starts the service on 127.0.0.1:port (0: any) in a thread."""
    orders = Orders(seconds_per_order)
    server = ThreadingHTTPServer(("127.0.0.1", port), handler_for(orders))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, orders


if __name__ == "__main__":
    server, _ = serve(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 1.5)
    print(f"orders service on 127.0.0.1:{server.server_address[1]}", flush=True)
    threading.Event().wait()
