"""The Ray Serve application: ingress, N engine replicas, one weights coordinator.

- ``app``: the deployments and the app builder (``deploy/serve.yaml``).
- ``config``: ``RayServeConfig``.
- ``replica``: one engine replica.
- ``coordinator``: fans each weight push out to every replica.
"""
