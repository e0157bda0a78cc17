"""Serving: the OpenAI-compatible server (server.py), its request queue (aio.py), parallel slots batched in one
target pass (slots.py), Ray Serve scale-out (scaleout.py) and the prefix cache (prefix_cache.py)."""
