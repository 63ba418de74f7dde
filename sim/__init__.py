"""disagg-router: sim."""
