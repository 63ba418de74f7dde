"""disagg-router: policies."""
