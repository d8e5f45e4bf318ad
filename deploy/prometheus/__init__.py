"""Prometheus config and the rules generated from Python (see ``rules``)."""
