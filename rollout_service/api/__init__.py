"""The HTTP API: the FastAPI app (``app``), the routers, and the protocols they call.

Handlers depend only on ``ports`` (typed protocols), so the same app serves one
engine in this process or a Ray Serve deployment of N replicas.
"""
