"""`pdserve role`: show engine roles or change one in place, through the scheduler's admin
endpoint (HTTP /admin/roles; a token with the admin scope when the scheduler has tokens)."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheduler-http", default="http://127.0.0.1:8000",
                        help="the scheduler's HTTP API (its http_port)")
    parser.add_argument("--token", default=os.environ.get("PDSERVE_TOKEN", ""),
                        help="bearer token (default: $PDSERVE_TOKEN)")
    parser.add_argument("engine_id", nargs="?", help="engine to change (none: list roles and changes)")
    parser.add_argument("role", nargs="?", choices=("prefill", "decode", "mixed"), help="its new role")
    parser.add_argument("--reason", default="set by an operator", help="logged with the change")


def run(args: argparse.Namespace) -> int:
    if (args.engine_id is None) != (args.role is None):
        raise ValueError("give both an engine id and a role, or neither")
    url = args.scheduler_http.rstrip("/") + "/admin/roles"
    data = None
    if args.engine_id is not None:
        data = json.dumps({"engine_id": args.engine_id, "role": args.role, "reason": args.reason}).encode()
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                     headers={"content-type": "application/json"})
    if args.token:
        request.add_header("authorization", f"Bearer {args.token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            print(json.dumps(json.loads(response.read()), indent=2))
            return 0
    except urllib.error.HTTPError as e:
        print(f"pdserve role: {e.code}: {e.read().decode(errors='replace')}")
        return 1
