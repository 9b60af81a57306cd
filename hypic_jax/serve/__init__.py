"""An OpenAI-compatible server over the shape-stable engine, with a continuous-batching scheduler.

`hypic-jax serve [MODEL]` (`hypic_jax.serve.app.main`); `Server` is the ASGI app and its lifecycle, `Scheduler`
the device loop (`hypic_jax.serve.scheduler`), `Metrics` the Prometheus metrics. The top layer of the package:
nothing else in `hypic_jax` imports it but the command line.
"""

from hypic_jax.serve.app import Server, build
from hypic_jax.serve.scheduler import ApiError, Request, SamplingParams, Scheduler

__all__ = ["Server", "build", "Scheduler", "Request", "SamplingParams", "ApiError"]
