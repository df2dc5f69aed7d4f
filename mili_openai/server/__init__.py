"""The HTTP server, whatever the API: the Starlette app and its lifespan, middleware, errors, SSE,
metrics, the per-request log and the graceful drain of `mili serve`."""
