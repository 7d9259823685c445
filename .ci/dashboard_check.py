#!/usr/bin/env python3
"""Evaluates every PromQL expression of the Grafana dashboard against a real Prometheus.

It starts Debian's `prometheus` scraping, every second:
  * `rlplane local manifests/rljob-cpu.yaml --metrics-port P --steps N` (the merged /metrics of
    every rank and the coordinator), and
  * the operator's real registry and HTTP server without a cluster
    (`cargo run -p rlplane-operator --example metrics_fixture`: a cache of RLJobs in every phase and
    simulated reconciles; the names, labels and types are the operator's own),
then checks that both targets scrape cleanly (Prometheus's OpenMetrics parser accepts the merged
exposition) and evaluates every panel expression and template query through the HTTP API. Any
error, empty result or result that is only NaN fails the check.

With --picture PNG it also draws every panel from range queries (matplotlib), as a person would
see the dashboard.

Exits 0 with "skipped: ..." when the prometheus binary is absent, unless RLPLANE_CI_REQUIRED=1
(as in CI), where a missing prometheus fails the check.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "charts/rlplane/dashboards/rlplane.json"
SCRAPE_INTERVAL_S = 1
# What Grafana would substitute for $__rate_interval at this scrape interval (at least 4 scrapes).
RATE_INTERVAL = "15s"


def free_port() -> int:
    """A free loopback port below the ephemeral range (as `rlplane::net::reserve_loopback_port`):
    a port from that range can be taken by any outgoing connection before the server binds it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_start = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_start = 0
    candidates = [random.randrange(10_000, ephemeral_start) for _ in range(256)] if ephemeral_start > 12_000 else []
    for port in candidates + [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free loopback port")


def http_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def panels_of(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard.get("panels", []):
        if p.get("type") == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def substitute(expr: str, rljob: str) -> str:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__interval", f"{SCRAPE_INTERVAL_S}s")
    expr = expr.replace("$__range", "1m")
    # A regex matching the name exactly, written as a PromQL string (backslashes doubled).
    literal = "".join("\\\\" + c if c in ".^$*+?()[]{}|\\" else c for c in rljob)
    return expr.replace("${rljob}", literal).replace("$rljob", literal)


class Prometheus:
    def __init__(self, port: int):
        self.base = f"http://127.0.0.1:{port}"

    def query(self, expr: str, at: float | None = None) -> dict:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        url = f"{self.base}/api/v1/query?{urllib.parse.urlencode(params)}"
        try:
            return http_json(url)
        except urllib.error.HTTPError as e:  # 400/422 carry the error as JSON
            return json.load(e)

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step}"}
        try:
            return http_json(f"{self.base}/api/v1/query_range?{urllib.parse.urlencode(params)}")
        except urllib.error.HTTPError as e:
            return json.load(e)

    def label_values(self, label: str, match: str) -> list[str]:
        q = urllib.parse.urlencode({"match[]": match})
        return http_json(f"{self.base}/api/v1/label/{label}/values?{q}").get("data", [])

    def targets(self) -> list[dict]:
        return http_json(f"{self.base}/api/v1/targets")["data"]["activeTargets"]


def verdict(result: dict) -> str | None:
    """None when the result has at least one series with a number, else why not."""
    if result.get("status") != "success":
        return f"error: {result.get('errorType')}: {result.get('error')}"
    data = result["data"]
    series = data["result"]
    if data["resultType"] == "scalar":
        series = [{"value": series}]
    if not series:
        return "empty result"
    values = [float(s["value"][1]) for s in series]
    if all(math.isnan(v) for v in values):
        return f"only NaN ({len(values)} series)"
    return None


def wait_until(what: str, check, timeout: float, every: float = 1.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last = e
        time.sleep(every)
    raise SystemExit(f"FAIL: {what} (after {timeout:.0f}s; last: {last})")


def draw(prom: Prometheus, dashboard: dict, rljob: str, start: float, end: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = panels_of(dashboard)
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.1 * rows), facecolor="#111217")
    step = max(1.0, (end - start) / 200)
    for ax, panel in zip(axes.flat, panels):
        ax.set_facecolor("#181b1f")
        ax.set_title(panel["title"], color="#d8d9da", fontsize=10, loc="left")
        ax.tick_params(colors="#8e8e8e", labelsize=7)
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        ax.grid(color="#2c3235", linewidth=0.5)
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        for target in panel["targets"]:
            r = prom.query_range(substitute(target["expr"], rljob), start, end, step)
            for s in r.get("data", {}).get("result", []):
                legend = target.get("legendFormat", "")
                legend = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: s["metric"].get(m.group(1), ""), legend)
                xs = [float(t) - start for t, _ in s["values"]]
                ys = [float(v) for _, v in s["values"]]
                if panel["type"] in ("bargauge", "stat"):
                    ax.barh(legend or "value", ys[-1] if ys else 0, color="#73bf69")
                else:
                    ax.plot(xs, ys, linewidth=1.2, label=legend)
        if panel["type"] not in ("bargauge", "stat"):
            ax.set_xlabel("seconds", color="#8e8e8e", fontsize=7)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6, facecolor="#181b1f", edgecolor="#2c3235", labelcolor="#d8d9da", loc="upper left")
        ax.set_ylabel(unit, color="#8e8e8e", fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"{dashboard['title']} — rljob {rljob} (rlplane local, 1 s scrapes)", color="#d8d9da")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80, facecolor=fig.get_facecolor())
    print(f"picture: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rlplane", default=str(ROOT / "target/debug/rlplane"), help="the rlplane binary")
    ap.add_argument("--fixture", default=str(ROOT / "target/debug/examples/metrics_fixture"),
                    help="the operator's metrics fixture (cargo build -p rlplane-operator --example metrics_fixture)")
    ap.add_argument("--manifest", default=str(ROOT / "manifests/rljob-cpu.yaml"))
    ap.add_argument("--dashboard", type=Path, default=DASHBOARD)
    ap.add_argument("--warmup", type=float, default=20, help="seconds of data before evaluating")
    ap.add_argument("--timeout", type=float, default=120, help="seconds to wait for every expression")
    ap.add_argument("--picture", type=Path, help="draw the panels into this PNG (needs matplotlib)")
    args = ap.parse_args()

    prometheus = shutil.which("prometheus")
    if not prometheus:
        if os.environ.get("RLPLANE_CI_REQUIRED") == "1":
            print("FAIL: the dashboard check needs prometheus (RLPLANE_CI_REQUIRED=1; apt-get install prometheus)", file=sys.stderr)
            return 1
        print("skipped: the dashboard check needs Debian's prometheus (apt-get install prometheus)")
        return 0
    for b in (args.rlplane, args.fixture):
        if not os.access(b, os.X_OK):
            print(f"FAIL: {b} is not built (see --help)", file=sys.stderr)
            return 1
    dashboard = json.loads(args.dashboard.read_text())
    panels = panels_of(dashboard)

    tmp = Path(tempfile.mkdtemp(prefix="rlplane-dashboard-"))
    procs: list[subprocess.Popen] = []
    try:
        rl_port, op_port, prom_port = free_port(), free_port(), free_port()
        config = {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
            "scrape_configs": [
                {"job_name": "rlplane-local", "static_configs": [{"targets": [f"127.0.0.1:{rl_port}"]}]},
                {"job_name": "rlplane-operator", "static_configs": [{"targets": [f"127.0.0.1:{op_port}"]}]},
            ],
        }
        (tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        log = open(tmp / "processes.log", "w")
        procs.append(subprocess.Popen(
            [args.fixture, f"127.0.0.1:{op_port}", str(int(args.warmup + args.timeout + 120))],
            stdout=log, stderr=log))
        procs.append(subprocess.Popen(
            [args.rlplane, "local", args.manifest, "--metrics-port", str(rl_port), "--steps", "1000000"],
            stdout=log, stderr=log, env={**os.environ, "RLPLANE_LOG": "warn"}))
        procs.append(subprocess.Popen(
            [prometheus, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=log, stderr=log))
        prom = Prometheus(prom_port)
        start = time.time()

        def targets_up():
            for p in procs:
                if p.poll() is not None:
                    log.flush()
                    raise SystemExit(f"FAIL: {p.args[0]} exited with {p.returncode}:\n{(tmp / 'processes.log').read_text()[-3000:]}")
            ts = prom.targets()
            return len(ts) == 2 and all(t["health"] == "up" for t in ts) and ts

        targets = wait_until("both targets scraped cleanly", targets_up, 120)
        print("targets up: " + ", ".join(f"{t['labels']['job']} ({t['scrapeUrl']})" for t in targets))
        time.sleep(args.warmup)

        # Template variables.
        rljobs = prom.label_values("rljob", "rlplane_steps_total")
        if not rljobs:
            print("FAIL: label_values(rlplane_steps_total, rljob) is empty", file=sys.stderr)
            return 1
        rljob = rljobs[0]
        for var in dashboard["templating"]["list"]:
            q = var.get("query")
            if isinstance(q, dict):
                m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", q["query"])
                assert m, f"unsupported template query {q['query']}"
                values = prom.label_values(m.group(2), m.group(1))
                print(f"{'ok' if values else 'FAIL':4} variable ${var['name']}: {values}")
                if not values:
                    return 1

        # Every expression, until all have data (the run keeps going meanwhile).
        exprs = [(p["title"], t["refId"], substitute(t["expr"], rljob)) for p in panels for t in p["targets"]]
        deadline = time.monotonic() + args.timeout
        while True:
            problems = []
            for title, ref, expr in exprs:
                why = verdict(prom.query(expr))
                if why and why.startswith("error"):
                    print(f"FAIL {title} [{ref}]: {expr}\n     {why}", file=sys.stderr)
                    return 1
                if why:
                    problems.append((title, ref, expr, why))
            if not problems or time.monotonic() > deadline:
                break
            time.sleep(2)
        for title, ref, expr in exprs:
            bad = [p for p in problems if p[:2] == (title, ref)]
            print(f"{'FAIL' if bad else 'ok':4} {title} [{ref}]" + (f": {bad[0][3]}\n     {expr}" if bad else ""))
        # Every target still scrapes without error (the merged exposition stays valid).
        for t in prom.targets():
            if t["health"] != "up" or t["lastError"]:
                print(f"FAIL target {t['scrapeUrl']}: {t['health']} {t['lastError']}", file=sys.stderr)
                return 1
        if problems:
            print(f"FAIL: {len(problems)} of {len(exprs)} expressions have no data", file=sys.stderr)
            return 1
        print(f"{len(exprs)} expressions of {len(panels)} panels evaluated with data")
        if args.picture:
            draw(prom, dashboard, rljob, start, time.time(), args.picture)
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
