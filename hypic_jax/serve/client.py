"""For programs that drive `hypic-jax serve` as a process of their own (benchmarks, tests, deployment checks):
start it, wait until it is ready, read its metrics. Standard library and prometheus_client only."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request


def launch(arguments: list[str], **popen) -> subprocess.Popen:
    """`hypic-jax serve ARGUMENTS...` in a new process of this Python (`popen`: subprocess.Popen's options)."""
    return subprocess.Popen([sys.executable, "-m", "hypic_jax.cli", "serve", *arguments], **popen)


def wait_ready(base: str, process: subprocess.Popen | None = None, timeout: float = 1800.0) -> float:
    """Poll `base`/health until it answers 200; returns the seconds waited. Raises RuntimeError when the warmup
    failed (500, with its error), the process exited, or `timeout` passed."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited during its start (status {process.returncode})")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except urllib.error.HTTPError as error:
            if error.code == 500:
                raise RuntimeError(f"the server's warmup failed: {json.loads(error.read()).get('error')}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet
        time.sleep(0.2)
    raise RuntimeError(f"the server was not ready within {timeout:.0f} s")


def metric(text: str, name: str, **labels) -> float:
    """The sum of the samples of metric `name` (with `labels`) in Prometheus text `text` (a /metrics body)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
