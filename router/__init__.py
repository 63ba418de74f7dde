"""disagg-router: router."""
