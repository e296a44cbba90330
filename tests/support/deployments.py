"""What deploy.app.build_app binds: the Serve deployments of one application, by name."""
from __future__ import annotations


def bound_deployments(app) -> dict:
    """name -> Deployment of the router application and the two it binds."""
    router = app._bound_deployment
    bound = [a._bound_deployment for a in router.init_args[:2]]
    return {d.name: d for d in [router, *bound]}
