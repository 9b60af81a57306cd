"""An OpenAI-compatible server over the engine, with its continuous-batching scheduler.

`hypic-jax serve [MODEL]` (`hypic_jax.serve.app.main`); `Server` is the ASGI app and its lifecycle, `ServerOptions`
its options (the engine's are `hypic_jax.engine.EngineOptions`), `Metrics` the Prometheus metrics; the device loop
is the engine's scheduler (`hypic_jax.engine.scheduler`). The top layer of the package: nothing else in `hypic_jax`
imports it but the command line.
"""

from hypic_jax.engine.scheduler import Request, RequestError, Scheduler
from hypic_jax.serve.app import Server, ServerOptions, build

ApiError = RequestError  # the server's name for it: an error answered in OpenAI's shape

__all__ = ["Server", "ServerOptions", "build", "Scheduler", "Request", "ApiError"]
