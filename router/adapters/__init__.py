"""disagg-router: router/adapters."""
