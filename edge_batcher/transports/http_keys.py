"""The keys of the HTTP application's shared state (aiohttp AppKeys), in a module of their own so
that the route modules (http.py, http_generate.py) read them without importing each other."""

from __future__ import annotations

from aiohttp import web

from ..runtime import Runtime
from ..shared_memory.cuda_regions import CudaRegionRegistry
from ..shared_memory.regions import RegionRegistry
from .body_budget import BodyBudget

RUNTIME = web.AppKey("runtime", Runtime)
# name -> callable giving a component's state for GET /v2/health/ready, e.g. {"mqtt": lambda: "connected"}.
HEALTH_CHECKS = web.AppKey("health_checks", dict)
BODY_BUDGET = web.AppKey("body_budget", BodyBudget)
SHARED_MEMORY = web.AppKey("shared_memory", RegionRegistry)  # the daemon's one registry, gRPC's too
CUDA_SHARED_MEMORY = web.AppKey("cuda_shared_memory", CudaRegionRegistry)  # likewise, for CUDA regions
