"""TODO index."""
