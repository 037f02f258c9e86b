"""Plain helpers shared by the tests (importable as `helpers.<module>`: pytest puts tests/ on
sys.path because tests/conftest.py sits there). Fixtures and pytest hooks live in tests/conftest.py;
no test module imports conftest."""
