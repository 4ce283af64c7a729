"""Root conftest: registers the service fixtures (a real worker, gateway, Celery client and
OpenAI client over the test session's redis-server, tests/gateway_service.py) for every test
module, so a module requests them by name instead of importing them."""

pytest_plugins = ["tests.gateway_service"]
