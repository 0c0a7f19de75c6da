"""Ray Serve deployments: one per model version, plus the server-wide ``/v2`` application."""
