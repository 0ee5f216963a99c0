"""The service's routers: ``service`` (health, metrics, info), ``blocks``, ``sequences``."""
