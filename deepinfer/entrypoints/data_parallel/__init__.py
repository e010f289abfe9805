"""Data-parallel serving: one front end routing requests to N `deepinfer serve` replicas
(launch.py, frontend.py, router.py, routing_key.py, replicas.py, metrics.py)."""
