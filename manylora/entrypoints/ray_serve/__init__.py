"""``manylora serve-ray``: the OpenAI-compatible server over several engine replicas on Ray
Serve, routed by adapter (Ray Serve's model multiplexing). ``build_app`` is the application
builder a Serve config names (``import_path: manylora.entrypoints.ray_serve:build_app``)."""

from manylora.entrypoints.ray_serve.app import build_app

__all__ = ["build_app"]
