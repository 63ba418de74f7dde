"""disagg-router: bench."""
