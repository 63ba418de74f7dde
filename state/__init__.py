"""disagg-router: state."""
