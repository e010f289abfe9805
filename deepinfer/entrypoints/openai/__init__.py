"""The OpenAI-compatible server behind `deepinfer serve` (see server.py for the routes)."""
